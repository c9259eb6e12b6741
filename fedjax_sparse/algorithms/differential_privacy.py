"""Client-level differential privacy for any algorithm whose server reads its uploads through their mean.

DP-FedAvg (McMahan et al., ICLR 2018), as one wrapper around the algorithm's own functions:

    client k:  Delta_k = its upload's change (upload - broadcast for a leaf the server sent, the leaf
               itself for a delta: `core.wrapping.UploadChanges`), over every leaf of the upload;
               Delta_k <- Delta_k min(1, C / ||Delta_k||)            (`flat`: one L2 norm over all of it)
               or each layer to C / sqrt(L) (`per_layer`: its L layers' bounds add up to C in L2);
               `local` noise: Delta_k + N(0, z^2 C^2), each client its own (no trusted server);
    server:    the algorithm's own server update, with every client counted equally (weights 1), the
               mean of the K' taking part made a sum over K, the expected number (a fixed denominator:
               a count that depended on who took part would itself need privacy; each change times K'/K,
               where participation varies), and `central` noise: one N(0, z^2 C^2) / K added to every
               slot's upload, so the mean the algorithm takes is (sum_k Delta_k + N(0, z^2 C^2)) / K.

Since the algorithm reads the uploads only through their mean (`FederatedAlgorithm.aggregates_mean`), what
it releases is a function of that noised sum: the subsampled Gaussian mechanism `core.privacy_accounting`
accounts, recorded every round. Where no bound binds and z = 0 the wrapper changes nothing of the upload,
bit for bit; the server then differs from the algorithm only by its equal weights (and, under varying
participation, the fixed denominator): FedAvg at --aggregation-weights uniform, SCAFFOLD, SpaFL, FedDyn
are themselves (tests/test_differential_privacy.py).

What the privacy covers: every leaf a client uploads, which is all of its client data that travels: the
model's weights and BatchNorm statistics (FedAvg, FedProx, FedDyn), SpaFL's thresholds, SCAFFOLD's model
delta and control variate.

Refused in one line: algorithms whose server needs each upload (FedLDF's per-client layer choice, the
sub-model family's masked means, SPATL's selected channels, FedPM's masks, FedNova's normalization: their
`aggregates_mean` is False), uploads holding integers or priced sparse leaves (a client-chosen index set,
top-k compression: an unnoised index reveals its client's data), and uplink compression beneath it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.core.algorithm import BuildContext, FederatedAlgorithm
from fedjax_sparse.core.messages import PRICED_LEAVES
from fedjax_sparse.core.options import option
from fedjax_sparse.core.privacy_accounting import ACCOUNTANTS
from fedjax_sparse.core.wrapping import broadcast_shapes, upload_changes, upload_shapes

NOISE_STREAM = 0x6470  # a client's round key, or the server's, folded with this draws its Gaussian noise


@dataclasses.dataclass(frozen=True)
class DifferentialPrivacyOptions:
    dp_clip: float | None = option(None, "client-level differential privacy: clip each client's update to this L2 "
                                         "norm C and add Gaussian noise of standard deviation z C (default: none)",
                                   low=0.0, low_open=True)
    dp_noise_multiplier: float = option(1.0, "z, the noise's standard deviation over the clip norm", low=0.0)
    dp_target_epsilon: float | None = option(None, "choose --dp-noise-multiplier before the run so that the run "
                                                   "spends this epsilon at --dp-delta (refused where none can)",
                                             low=0.0, low_open=True)
    dp_delta: float | None = option(None, "the delta epsilon is reported at (default 1 / num_clients^1.1)", low=0.0,
                                    low_open=True, high=1.0, high_open=True)
    dp_clipping: str = option("flat", "flat: one L2 norm over the whole update; per_layer: each layer to "
                                      "C / sqrt(layers)", choices=("flat", "per_layer"))
    dp_noise: str = option("central", "central: the server noises the sum (a trusted server); local: each client "
                                      "noises its own update", choices=("central", "local"))
    dp_accountant: str = option("rdp", "the accountant (dp-accounting): rdp (Renyi DP) or pld (privacy loss "
                                       "distributions: Poisson sampling and local noise)", choices=ACCOUNTANTS)

    def ignored(self) -> dict[str, str]:
        if self.dp_clip is None:
            return {name: "is read only with --dp-clip" for name in (
                "dp_noise_multiplier", "dp_target_epsilon", "dp_delta", "dp_clipping", "dp_noise", "dp_accountant")}
        if self.dp_target_epsilon is not None:
            return {"dp_noise_multiplier": "is chosen by --dp-target-epsilon"}
        return {}


def _layer(path: str) -> str:
    return path.rsplit("/", 1)[0]


def privatize(algorithm: FederatedAlgorithm, context: BuildContext, options: DifferentialPrivacyOptions, *,
              noise_multiplier: float, expected_clients: int) -> FederatedAlgorithm:
    """`algorithm` with its clients' updates clipped and noised (the module docstring); `noise_multiplier`: z,
    resolved by the run (`--dp-target-epsilon` calibrates it); `expected_clients`: K, the mean's denominator."""
    if options.dp_clip is None:
        return algorithm
    name, clip, z = algorithm.name, float(options.dp_clip), float(noise_multiplier)
    if not algorithm.aggregates_mean or algorithm.select_uploads is not None:
        raise ValueError(f"--dp-clip: {name}'s server needs each client's upload (a per-client choice or a masked "
                         f"mean), so a noised sum cannot stand in for them; differential privacy applies to fedavg, "
                         f"fedprox, feddyn, scaffold and spafl")
    up_shape = upload_shapes(algorithm, context)
    leaves = jax.tree_util.tree_leaves(up_shape, is_leaf=lambda x: isinstance(x, PRICED_LEAVES))
    if any(isinstance(x, PRICED_LEAVES) or not jnp.issubdtype(x.dtype, jnp.floating) for x in leaves):
        raise ValueError(f"--dp-clip: {name}'s upload holds integer or sparse leaves (counts, client-chosen "
                         f"indexes), which clipping and noise cannot cover; its privacy could not be accounted")
    message = upload_changes(up_shape, broadcast_shapes(algorithm, context), lambda path, leaf: True)
    layers = sorted({_layer(p) for p in message.paths})
    bound = {p: clip / len(layers) ** 0.5 if options.dp_clipping == "per_layer" else clip for p in message.paths}

    def clipped(changes):
        """The changes within their bounds, the update's norm before clipping, and whether a bound bound."""
        squares = {p: jnp.sum(jnp.square(x.astype(jnp.float32))) for p, x in changes.items()}
        norm = jnp.sqrt(sum(squares.values()))
        if options.dp_clipping == "flat":
            over = {p: norm for p in changes}
        else:
            layer_norm = {layer: jnp.sqrt(sum(squares[p] for p in changes if _layer(p) == layer)) for layer in layers}
            over = {p: layer_norm[_layer(p)] for p in changes}
        scale = {p: jnp.minimum(1.0, bound[p] / jnp.maximum(over[p], 1e-30)) for p in changes}
        binding = jnp.any(jnp.stack([scale[p] < 1.0 for p in changes]))
        return {p: (x * scale[p]).astype(x.dtype) for p, x in changes.items()}, norm, binding

    def gaussian(tree, key, std):
        """N(0, std^2) shaped like every leaf of `tree`."""
        flat, structure = jax.tree_util.tree_flatten(tree)
        keys = jax.random.split(jax.random.fold_in(key, NOISE_STREAM), len(flat))
        draws = [(std * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) for k, x in zip(keys, flat)]
        return jax.tree_util.tree_unflatten(structure, draws)

    def client_update(down, state, data, key, info):
        up, state, metrics = algorithm.client_update(down, state, data, key, info)
        changes, rest = message.split(up, down)
        changes, norm, binding = clipped(changes)
        if options.dp_noise == "local" and z > 0:
            changes = jax.tree_util.tree_map(jnp.add, changes, gaussian(changes, key, z * clip))
            binding = jnp.bool_(True)
        # where no bound binds (and no noise is added) the upload as the algorithm made it, bit for bit
        sent = jax.tree_util.tree_map(lambda new, old: jnp.where(binding, new, old),
                                      message.rebuild(changes, rest, down), up)
        return sent, state, {**metrics, "update_norm": norm, "update_clipped": (norm > clip).astype(jnp.float32)}

    def server_update(server_state, ups, weights, info):
        present = jnp.ones(weights.shape, bool) if info.participating is None else info.participating
        if info.participating is not None:
            # the mean over the K' present becomes the sum over K, the expected number (a fixed denominator)
            downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(info.client_ids)
            changes, rest = message.split(ups, downs)
            factor = jnp.sum(present).astype(jnp.float32) / expected_clients
            ups = message.rebuild({p: (x * factor).astype(x.dtype) for p, x in changes.items()}, rest, downs)
        if options.dp_noise == "central" and z > 0:
            # one draw added to every slot: the mean the algorithm takes gains N(0, (z C)^2) / K
            one = jax.tree_util.tree_map(lambda x: x[0], ups)
            drawn = gaussian(one, info.server_key, z * clip / expected_clients)
            ups = jax.tree_util.tree_map(lambda x, d: x + d[None], ups, drawn)
        return algorithm.server_update(server_state, ups, present.astype(weights.dtype), info)

    return dataclasses.replace(algorithm, client_update=client_update, server_update=server_update,
                               stale_upload=None)
