"""Client-level differential privacy for any algorithm whose server reads its uploads through sums of the
clients' changes.

DP-FedAvg (McMahan et al., ICLR 2018), as one wrapper around the algorithm's own functions:

    client k:  Delta_k = its upload's released change (upload - broadcast for a leaf that is a new value of
               one the server sent, the leaf itself for a delta: `core.contract.wrapping.UploadChanges`);
               Delta_k <- Delta_k min(1, C / ||Delta_k||)            (`flat`: one L2 norm over all of it)
               or each layer to C / sqrt(L) (`per_layer`: its L layers' bounds add up to C in L2);
               `local` noise: Delta_k + N(0, z^2 C^2), each client its own (no trusted server);
    server:    the algorithm's own server update, with every client counted equally (weights 1), each
               entry's mean made a sum over a fixed denominator D (K, the expected clients, or the
               algorithm's own count: a count that depended on who took part would itself need privacy;
               each change times (its senders / D)), and `central` noise: one N(0, (s z C)^2) / D added to
               every slot's upload, so the mean the algorithm takes is (sum_k Delta_k + N(0, (s z C)^2)) / D.
               Where participation varies (Poisson sampling, stragglers) and the server reads the plain mean,
               it is told that K fixed slots took part, each holding that released mean: a server that also
               reads the present clients' sum (SCAFFOLD's control variate, FedDyn's h: their number times
               the mean) then reads the noised sum, not K' / K of it, which would tell K'. A round nobody
               took part in is noised as any other (`steps_when_empty`): an unchanged model would tell it.

What the wrapper reads of the algorithm is its `core.contract.algorithm.PrivateSum`: which leaves are released and
of what they are changes, how it may be clipped, the denominator, and s, how far (in clip norms) one client
moves the sums. A server reading the plain mean (`aggregates_mean`: FedAvg, FedProx, FedDyn, SCAFFOLD,
SpaFL) is a plain sum: s = 1 where a client is added or removed, 2 where it is replaced, the sensitivities
`privacy.accounting` accounts a noise of z C against; an algorithm whose sums move by s C gets the
noise s z C over the accounted sensitivity, so the accountant's z remains the noise over the true one.
Each declaration's argument is in its algorithm's file:

  FedLDF (`fedldf.py`): per layer, the mean of the n clients whose layer moved most. One client added moves
    each layer's chosen set by one entry in and one out, so the sums move by up to 2 C (replaced: 2 C too),
    with every layer clipped to C / sqrt(L) (flat clipping is refused: the clients it displaces differ from
    layer to layer); D = n; its divergences are read by the server alone and neither clipped nor noised, so
    local noise is refused (they would leave the clients unnoised);
  top-k (or random-k) uplink compression (`uplink_compression.py`), with or without error feedback: this
    wrapper sits outside the compression (`run.experiment` composes them so), so it clips the compressed
    message itself: its values, its mask (and so its sparse price) kept; the residual error feedback keeps
    is the client's and is never sent. s = 1 (2 replaced), D = K; the server adds dense noise to the dense
    sum of the messages. Local noise is refused for top-k: it would noise the values sent and leave the
    client-chosen indexes bare.

Since the algorithm reads the uploads only through those sums, what it releases is a function of the
noised sums: the subsampled Gaussian mechanism `privacy.accounting` accounts, recorded every round. A
client's message may depend on its own state (SCAFFOLD's control variate, SpaFL's personal model, FedDyn's
correction, error feedback's residual), so on its own past rounds, which are not released. Under Poisson
sampling the account holds against an adversary shown more than the run releases: every other client's
state, sampling and randomness. Given all it has seen, a round's output with the client is a mixture, over
that client's hidden state, of subsampled Gaussians whose one differing contribution is within s C, and
without it one fixed distribution; Renyi and hockey-stick divergences are quasi-convex in either argument with
the other fixed, so the mixture costs no more than its worst component and the rounds compose as the
accountant composes them. Sampling K of N without replacement cannot show the others' sampling or state
(either reveals whether the client took part), and hidden, the neighbouring federations' posteriors over them
differ, so no amplified bound follows. The unamplified one does: shown everything but the client's data and
state (the sampling included), a round it takes part in is a mixture over its state of Gaussians of sensitivity
2 C (replaced; a coupling of the two federations' states bounds it by its worst pair), so such a run (any leaf in `init`'s client
states, `keeps_client_state`) is accounted without amplification: sampling 'unamplified', the event local
noise has, with the central noise (the run says so in one line). Local noise keeps its account: each
message, whatever the state, is a Gaussian within C of zero.

Where no bound binds and z = 0 the wrapper changes nothing of the upload, bit for bit; the server then
differs from the algorithm only by its equal weights (and, under varying participation, the fixed
denominator): FedAvg at --aggregation-weights uniform, SCAFFOLD, SpaFL, FedDyn, FedLDF with equal weights,
top-k with error feedback are themselves (tests/test_differential_privacy.py,
tests/test_differential_privacy_sparse.py).

Adaptive clipping (`--dp-target-quantile gamma`; Andrew et al., NeurIPS 2021, Algorithm 1 with their
geometric update): the clip norm starts at `--dp-clip`, travels with the model, and after each round steps
C <- C exp(-eta (b - gamma)), b the noised share of clients whose update was within C (each client sends
its indicator centred, 1/2 within C and -1/2 over it, as their estimator and TF Privacy's quantile query do;
the server adds N(0, sigma_b^2) to their sum, sigma_b = `--dp-count-noise`, K / 20 by default, divides by K
and adds 1/2). Centred, the sum moves by 1/2 where a client is added or removed (by 1 where one is
replaced): half the update sum's sensitivity, so the count's privacy is paid out of the same budget with
the update's noise multiplier z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (their section 3.1), and the
accountant's z is the run's total. (An uncentred count, 0 or 1 a client, would move by 1 where a client is
added: under Poisson sampling twice what that budget pays for.) Local noise does not take it: the server
noises the count. The norm is kept beside the algorithm's server state (a dict) and logged as
`server_dp_clip_norm` (the norm the round's clients were sent).

What the privacy covers: every leaf a client uploads that the server aggregates, which is all of its client
data that the model carries: the model's weights and BatchNorm statistics (FedAvg, FedProx, FedDyn),
SpaFL's thresholds, SCAFFOLD's model delta and control variate, FedLDF's layers, a compressed message's
values. FedLDF's divergences steer the server's choice only (a trusted server's, under central noise).

Refused in one line: algorithms whose server needs each upload and declares no `PrivateSum` (the sub-model
family's masked means, SPATL's selected channels, FedPM's masks, FedNova's normalization, FedLDF's random
baselines), uploads holding integer, quantized or coded leaves (`qsgd`), local noise where the upload holds
client-chosen indexes or feedback, flat clipping where the declaration needs it per layer, central noise on
clients that keep state accounted as amplified by sampling K of N, and a `PrivateSum` that cannot describe the upload
(`core.contract.check.check_private_sum`).

Why one module past 400 lines: the mechanism is one wrapper (clip, noise, the adaptive clip norm's private count,
the fixed-denominator release) whose parts must agree for the accountant's figure to hold; accounting and the run's
side are `accounting` and `ledger`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sparse.core.contract.algorithm import BuildContext, FederatedAlgorithm, PrivateSum, ServerStep, server_step
from fedjax_sparse.core.contract.check import check_private_sum
from fedjax_sparse.core.messages.pricing import PRICED_LEAVES, KnownMaskArray, SparseArray
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.privacy.accounting import (ACCOUNTANTS, ACCOUNTED_SENSITIVITY, RELATION, adaptive_update_noise,
                                                   count_noise_of)
from fedjax_sparse.core.contract.wrapping import (broadcast_shapes, flat_leaves, on_values, state_shapes, upload_changes,
                                         upload_shapes)

NOISE_STREAM = 0x6470  # a client's round key, or the server's, folded with this draws its Gaussian noise
COUNT_STREAM = 0x636E  # the server's round key folded with this draws adaptive clipping's count noise
CLIP_KEY = "dp_clip"  # adaptive clipping's norm, beside the algorithm's server state
SPARSE_LEAVES = (SparseArray, KnownMaskArray)  # values at some entries: clipped and noised by their values


@dataclasses.dataclass(frozen=True)
class DifferentialPrivacyOptions:
    OPTION_GROUP = "privacy"  # the command line's help group (`core.contract.options.option_group`)

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
    dp_target_quantile: float | None = option(None, "adaptive clipping (Andrew et al. 2021): the clip norm, from "
                                                    "--dp-clip, follows this quantile of the clients' update norms "
                                                    "(default: fixed)", low=0.0, high=1.0)
    dp_clip_lr: float = option(0.2, "adaptive clipping: the geometric step of the clip norm each round", low=0.0,
                               low_open=True)
    dp_count_noise: float | None = option(None, "adaptive clipping: the noise on the count of clients under the clip "
                                                "norm (default: the clients per round / 20, the paper's)",
                                          low=0.0, low_open=True)
    dp_record_unreleased: bool = option(False, "also record, every round, the figures the privacy does not cover "
                                               "(the training loss, the clients' update norms and accuracies, who "
                                               "took part, bytes, FLOPs, time): a simulation's diagnostics, not for "
                                               "publishing (default: the metrics hold what is released)")

    def ignored(self) -> dict[str, str]:
        names = ("dp_noise_multiplier", "dp_target_epsilon", "dp_delta", "dp_clipping", "dp_noise", "dp_accountant",
                 "dp_target_quantile", "dp_clip_lr", "dp_count_noise", "dp_record_unreleased")
        if self.dp_clip is None:
            return {name: "is read only with --dp-clip" for name in names}
        out = {"dp_noise_multiplier": "is chosen by --dp-target-epsilon"} if self.dp_target_epsilon is not None else {}
        if self.dp_target_quantile is None:
            out.update({name: "is read only with --dp-target-quantile" for name in ("dp_clip_lr", "dp_count_noise")})
        return out


def _layer(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _dense(leaf):
    """What a leaf stands for: an array, or a sparse leaf's values where it sends them and zeros elsewhere."""
    return leaf.dense() if isinstance(leaf, SPARSE_LEAVES) else leaf


def private_sum_of(algorithm: FederatedAlgorithm) -> PrivateSum | None:
    """What `algorithm` declares of its sums (`PrivateSum`): its own declaration, the plain mean's where it reads
    its uploads only through that, else None (its privacy cannot be accounted here)."""
    if algorithm.private_sum is not None:
        return algorithm.private_sum
    return PrivateSum() if algorithm.aggregates_mean and algorithm.select_uploads is None else None


def keeps_client_state(algorithm: FederatedAlgorithm, context: BuildContext) -> bool:
    """Whether `algorithm`'s clients keep state between rounds (a leaf in `init`'s client states: its own, or a
    wrapper's, as error feedback's residual or personal layers), which sampling K of N does not amplify."""
    return bool(jax.tree_util.tree_leaves(state_shapes(algorithm, context)[1]))


def privatize(algorithm: FederatedAlgorithm, context: BuildContext, options: DifferentialPrivacyOptions, *,
              noise_multiplier: float, expected_clients: int, sampling: str = "poisson") -> FederatedAlgorithm:
    """`algorithm` with its clients' updates clipped and noised (the module docstring); `noise_multiplier`: z,
    resolved by the run (`--dp-target-epsilon` calibrates it); `expected_clients`: K, the mean's denominator;
    `sampling`: how the run is accounted (`PrivacyLedger.sampling`): its neighbouring relation sets the noise of
    an algorithm whose sums move otherwise than a plain sum's; 'uniform' (amplified by sampling K of N)
    refuses clients that keep state, which are accounted 'unamplified'."""
    if options.dp_clip is None:
        return algorithm
    name, clip, z = algorithm.name, float(options.dp_clip), float(noise_multiplier)
    declared = private_sum_of(algorithm)
    if declared is None:
        raise ValueError(f"--dp-clip: {name}'s server needs each client's upload (a per-client choice or a masked "
                         f"mean), so a noised sum cannot stand in for them; differential privacy applies to fedavg, "
                         f"fedprox, feddyn, scaffold, spafl, fedldf and their top-k or random-k uplink compression")
    if sampling not in RELATION:
        raise ValueError(f"privatize: sampling must be one of {', '.join(RELATION)}, got {sampling!r}")
    relation = RELATION[sampling]
    adaptive = options.dp_target_quantile is not None
    if sampling == "uniform" and options.dp_noise == "central" and z > 0 and keeps_client_state(algorithm, context):
        raise ValueError(f"privatize: {name}'s clients keep state between rounds, which sampling K of N does not "
                         f"amplify (the module docstring); account it as sampling='unamplified'")
    up_shape = upload_shapes(algorithm, context)
    check_private_sum(name, declared, up_shape, context.clients_per_round)

    def fed_back(path):
        return any(path == f or path.startswith(f + "/") for f in declared.feedback)

    message = upload_changes(up_shape, broadcast_shapes(algorithm, context), lambda path, leaf: not fed_back(path),
                             declared.references)
    released = {p: leaf for p, leaf in flat_leaves(up_shape).items() if p in message.paths}
    for leaf in released.values():
        values = leaf.values if isinstance(leaf, SPARSE_LEAVES) else leaf
        if isinstance(values, PRICED_LEAVES) or not jnp.issubdtype(values.dtype, jnp.floating):
            raise ValueError(f"--dp-clip: {name}'s upload holds integer, quantized or coded leaves (counts, QSGD's "
                             f"levels, masks), which clipping and noise cannot cover; its privacy could not be "
                             f"accounted (uplink compression under it: topk or randk)")
    if options.dp_noise == "local" and declared.feedback:
        raise ValueError(f"--dp-noise local: {name}'s clients also send what its server chooses by "
                         f"({', '.join(declared.feedback)}), which local noise would leave unnoised; use --dp-noise "
                         f"central (a trusted server)")
    if options.dp_noise == "local" and any(isinstance(x, SparseArray) for x in released.values()):
        raise ValueError(f"--dp-noise local: {name}'s upload holds client-chosen indexes (sparse leaves: top-k's), "
                         f"which noise on the values sent would leave unnoised; use --dp-noise central")
    if declared.clip_layers is None:
        layer_of = {p: _layer(p) for p in message.paths}
    elif options.dp_clipping == "flat":
        raise ValueError(f"--dp-clipping flat: {name}'s sums move by at most {declared.sensitivity:g} C per client "
                         f"only with each of its layers clipped on its own (the clients it displaces differ from "
                         f"layer to layer, and flat clipping would let them add up to C sqrt(layers)); use "
                         f"--dp-clipping per_layer")
    else:
        layer_of = dict(declared.clip_layers)
    layers = sorted({layer_of[p] for p in message.paths})
    share = {p: 1 / len(layers) ** 0.5 if options.dp_clipping == "per_layer" else 1.0 for p in message.paths}
    count_noise = count_noise_of(options.dp_count_noise, expected_clients)
    # adaptive clipping spends part of the budget on the count (Andrew et al. 2021, section 3.1): the update's
    # noise z_delta and the count's sigma_b together cost one Gaussian of multiplier z
    update_z = adaptive_update_noise(z, count_noise) if adaptive else z
    # the noise the accountant's z stands for, in clip norms: the algorithm's sensitivity over the plain sum's
    sensitivity = (declared.sensitivity if relation == "add_or_remove" else declared.replace_sensitivity) \
        / ACCOUNTED_SENSITIVITY[relation]
    masked = declared.denominator is not None
    denominator = declared.denominator if masked else expected_clients
    noised_paths = [p for p in message.order if p in message.paths]  # the treedef's order: one key each
    if adaptive:
        server_shape = state_shapes(algorithm, context)[0]
        if not isinstance(server_shape, dict) or CLIP_KEY in server_shape:
            raise ValueError(f"--dp-target-quantile keeps the clip norm beside {name}'s server state, which must "
                             f"be a dict without a {CLIP_KEY!r} key")

    def clipped(changes, clip):
        """The changes within their bounds, the update's norm before clipping, and whether a bound bound."""
        squares = {p: jnp.sum(jnp.square(_dense(x).astype(jnp.float32))) for p, x in changes.items()}
        norm = jnp.sqrt(sum(squares.values()))
        if options.dp_clipping == "flat":
            over = {p: norm for p in changes}
        else:
            layer_norm = {layer: jnp.sqrt(sum(squares[p] for p in changes if layer_of[p] == layer))
                          for layer in layers}
            over = {p: layer_norm[layer_of[p]] for p in changes}
        scale = {p: jnp.minimum(1.0, clip * share[p] / jnp.maximum(over[p], 1e-30)) for p in changes}
        binding = jnp.any(jnp.stack([scale[p] < 1.0 for p in changes]))
        return {p: on_values(lambda v, s=scale[p]: (v * s).astype(v.dtype), x) for p, x in changes.items()}, norm, \
            binding

    def gaussian(shapes, key, std):
        """N(0, std^2) shaped like each of `shapes` (arrays), one key each, in their order."""
        keys = jax.random.split(jax.random.fold_in(key, NOISE_STREAM), len(shapes))
        return [(std * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) for k, x in zip(keys, shapes)]

    def private_upload(down, up, key, clip):
        changes, rest = message.split(up, down)
        changes, norm, binding = clipped(changes, clip)
        if options.dp_noise == "local" and update_z > 0:
            values = [x.values if isinstance(x, SPARSE_LEAVES) else x for x in changes.values()]
            drawn = gaussian(values, key, update_z * clip)
            changes = {p: on_values(lambda v, d=d: v + d, x) for (p, x), d in zip(changes.items(), drawn)}
            binding = jnp.bool_(True)
        # where no bound binds (and no noise is added) the upload as the algorithm made it, bit for bit
        sent = jax.tree_util.tree_map(lambda new, old: jnp.where(binding, new, old),
                                      message.rebuild(changes, rest, down), up)
        return sent, norm

    def client_update(down, state, data, key, info):
        up, state, metrics = algorithm.client_update(down, state, data, key, info)
        sent, norm = private_upload(down, up, key, clip)
        return sent, state, {**metrics, "update_norm": norm, "update_clipped": (norm > clip).astype(jnp.float32)}

    central = options.dp_noise == "central" and update_z > 0

    def released_mean(server_state, ups, present, info, clip):
        """Where participation varies, for a server reading the plain mean: (uploads, slots) such that the
        algorithm, told that the first K `slots` took part, reads the released mean alone: every slot's upload
        is the broadcast plus (the present clients' changes summed, + the noise) / K. A server that also reads
        the present clients' sum (SCAFFOLD's control variate, FedDyn's h: their number times the mean) then
        reads the noised sum itself, not K' / K of it, and an empty round is noised as any other."""
        slots = present.shape[0]
        if slots < expected_clients:
            raise ValueError(f"privatize: {slots} slots cannot stand for the {expected_clients} expected clients")
        downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(info.client_ids)
        changes, rest = message.split(ups, downs)
        changes = {p: _dense(x) for p, x in changes.items()}  # a sparse leaf's zeros count in the mean: sent dense
        drawn = dict(zip(noised_paths, gaussian([changes[p][0] for p in noised_paths], info.server_key,
                                                update_z * clip * sensitivity))) if central else {}
        mean = {}
        for p, x in changes.items():
            total = jnp.sum(jnp.where(present.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), 0.0),
                            axis=0)
            total = total + drawn[p].astype(jnp.float32) if p in drawn else total
            mean[p] = jnp.broadcast_to((total / expected_clients).astype(x.dtype), x.shape)
        return message.rebuild(mean, rest, downs), jnp.arange(slots) < expected_clients

    def fixed_denominator(server_state, ups, present, info):
        """The uploads whose masked mean, as the algorithm takes it, is the sum of the changes over the fixed
        denominator: each change times (its senders / denominator); the uploads as they are where that is 1.
        In a round nobody took part, the first slot carries every entry (a change of zero; `private_server_update`
        counts it present), so that its noise is released as any round's."""
        downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(info.client_ids)
        changes, rest = message.split(ups, downs)
        nobody = ~jnp.any(present)
        factors = {}
        for p, x in changes.items():
            carried = x.mask if isinstance(x, SPARSE_LEAVES) else jnp.ones(x.shape, bool)
            senders = jnp.sum(carried & present.reshape((-1,) + (1,) * (carried.ndim - 1)), axis=0)
            factors[p] = senders.astype(jnp.float32) / denominator
            if isinstance(x, SPARSE_LEAVES):
                changes[p] = x.replace(mask=x.mask.at[0].set(x.mask[0] | nobody))
        scaled = flat_leaves(message.rebuild({p: on_values(lambda v, f=factors[p]: (v * f[None]).astype(v.dtype), x)
                                              for p, x in changes.items()}, rest, downs))
        flat = flat_leaves(ups)

        def kept(p):  # an entry whose senders are the denominator keeps its upload bit for bit (and its mask)
            old = flat[p].values if isinstance(flat[p], SPARSE_LEAVES) else flat[p]
            return on_values(lambda v: jnp.where(factors[p][None] == 1.0, old, v), scaled[p])

        return jax.tree_util.tree_unflatten(message.structure, [kept(p) if p in factors else flat[p]
                                                                for p in message.order])

    def private_server_update(server_state, ups, weights, info, clip):
        varying = info.participating is not None
        present = info.participating if varying else jnp.ones(weights.shape, bool)
        if varying and not masked:
            ups, fixed = released_mean(server_state, ups, present, info, clip)
            return algorithm.server_update(server_state, ups, fixed.astype(weights.dtype),
                                           info.replace(participating=fixed))
        if masked:
            ups = fixed_denominator(server_state, ups, present, info)
            if varying:  # the first slot carries an empty round
                present = present.at[0].set(present[0] | ~jnp.any(present))
                info = info.replace(participating=present)
        if central:
            # one draw added to every slot: the mean the algorithm takes gains N(0, (s z C)^2) / denominator, s the
            # algorithm's sensitivity; a sparse leaf whose zeros count in the mean is sent dense (the noise is)
            flat = flat_leaves(ups)
            if not masked:
                flat = {p: _dense(x) if p in message.paths else x for p, x in flat.items()}
            one = [(flat[p].values if isinstance(flat[p], SPARSE_LEAVES) else flat[p])[0] for p in noised_paths]
            drawn = dict(zip(noised_paths, gaussian(one, info.server_key,
                                                    update_z * clip * sensitivity / denominator)))
            flat = {p: on_values(lambda v, d=drawn[p]: v + d[None], x) if p in drawn else x for p, x in flat.items()}
            ups = jax.tree_util.tree_unflatten(message.structure, [flat[p] for p in message.order])
        return algorithm.server_update(server_state, ups, present.astype(weights.dtype), info)

    if not adaptive:
        def server_update(server_state, ups, weights, info):
            return private_server_update(server_state, ups, weights, info, clip)

        return dataclasses.replace(algorithm, client_update=client_update, server_update=server_update,
                                   stale_upload=None, private_sum=None, steps_when_empty=central)

    def inner(server_state):
        return {k: v for k, v in server_state.items() if k != CLIP_KEY}

    def init(key, variables, num_clients):
        server_state, clients = algorithm.init(key, variables, num_clients)
        return {**server_state, CLIP_KEY: jnp.float32(clip)}, clients

    def broadcast(server_state, client_id, info):  # the clip norm travels with the model (4 bytes)
        return {"message": algorithm.broadcast(inner(server_state), client_id, info), CLIP_KEY: server_state[CLIP_KEY]}

    def adaptive_client_update(down, state, data, key, info):
        up, state, metrics = algorithm.client_update(down["message"], state, data, key, info)
        sent, norm = private_upload(down["message"], up, key, down[CLIP_KEY])
        under = (norm <= down[CLIP_KEY]).astype(jnp.float32)
        # client data too, centred (1/2 or -1/2) so that a client added or removed moves its noised sum by 1/2
        return {"update": sent, "under_clip": under - 0.5}, state, {**metrics, "update_norm": norm,
                                                                    "update_clipped": 1.0 - under,
                                                                    "clip_norm": down[CLIP_KEY]}

    def adaptive_server_update(server_state, ups, weights, info):
        clip_now = server_state[CLIP_KEY]
        present = jnp.ones(weights.shape, bool) if info.participating is None else info.participating
        new, step_metrics = server_step(private_server_update(inner(server_state), ups["update"], weights, info,
                                                              clip_now))
        centred = jnp.sum(jnp.where(present, ups["under_clip"], 0.0))
        if z > 0:
            centred = centred + count_noise * jax.random.normal(jax.random.fold_in(info.server_key, COUNT_STREAM))
        under = centred / expected_clients + 0.5  # the share of clients under the norm: it steps toward the quantile
        new = {**new, CLIP_KEY: clip_now * jnp.exp(-options.dp_clip_lr * (under - options.dp_target_quantile))}
        return ServerStep(new, {**step_metrics, "dp_clip_norm": clip_now})  # released: it was broadcast

    select_uploads = None
    if algorithm.select_uploads is not None:  # the server's choice reads the algorithm's own upload
        def select_uploads(ups, weights, info):
            return {**ups, "update": algorithm.select_uploads(ups["update"], weights, info)}

    return dataclasses.replace(algorithm, init=init, broadcast=broadcast, client_update=adaptive_client_update,
                               server_update=adaptive_server_update, select_uploads=select_uploads,
                               stale_upload=None, private_sum=None, steps_when_empty=central)
