"""Privacy, as one feature: client-level differential privacy from the mechanism to the epsilon a run reports.

`mechanism` wraps any algorithm whose server reads its uploads through a mean or bounded sums (DP-FedAvg:
per-client clipping, flat or per layer, central or local Gaussian noise, adaptive clipping with a centred
clipped-count; `DifferentialPrivacyOptions`, the `--dp-*` flags). `accounting` turns its noise, sampling and rounds
into (epsilon, delta) with Google's dp-accounting (RDP or PLD), calibrates a noise multiplier to a target
epsilon, and splits it with adaptive clipping's count. `ledger` is the run's side: the checks a run makes before
its first round (what cannot be accounted is refused in one line), the ledger it keeps, epsilon in every
round's record, and which of a round's figures a private run records (those it releases). Secure aggregation's
cost in bytes is a message's (`core.messages.secure_aggregation`). docs/privacy.md says what is private and what
is not.

Sits beside the algorithms: may import core and data; the run layer imports it.
"""
