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

Adaptive clipping (`--dp-target-quantile gamma`; Andrew et al., NeurIPS 2021, Algorithm 1 with their
geometric update): the clip norm starts at `--dp-clip`, travels with the model, and after each round steps
C <- C exp(-eta (b - gamma)), b the noised share of clients whose update was within C (each client sends
its indicator; the server adds N(0, sigma_b^2) to their sum, sigma_b = `--dp-count-noise`, K / 20 by
default, and divides by K). The count's privacy is paid out of the same budget: the update's noise
multiplier becomes z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (their section 3.1), so the accountant's z is
the run's total. The norm is kept beside the algorithm's server state (a dict) and logged as
`client_clip_norm`.

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

from fedjax_sparse.core.algorithm import BuildContext, FederatedAlgorithm, ServerStep, server_step
from fedjax_sparse.core.messages import PRICED_LEAVES
from fedjax_sparse.core.options import option
from fedjax_sparse.core.privacy_accounting import ACCOUNTANTS, adaptive_update_noise
from fedjax_sparse.core.wrapping import broadcast_shapes, upload_changes, upload_shapes

NOISE_STREAM = 0x6470  # a client's round key, or the server's, folded with this draws its Gaussian noise
COUNT_STREAM = 0x636E  # the server's round key folded with this draws adaptive clipping's count noise
CLIP_KEY = "dp_clip"  # adaptive clipping's norm, beside the algorithm's server state


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
    dp_target_quantile: float | None = option(None, "adaptive clipping (Andrew et al. 2021): the clip norm, from "
                                                    "--dp-clip, follows this quantile of the clients' update norms "
                                                    "(default: fixed)", low=0.0, high=1.0)
    dp_clip_lr: float = option(0.2, "adaptive clipping: the geometric step of the clip norm each round", low=0.0,
                               low_open=True)
    dp_count_noise: float | None = option(None, "adaptive clipping: the noise on the count of clients under the clip "
                                                "norm (default: the clients per round / 20, the paper's)",
                                          low=0.0, low_open=True)

    def ignored(self) -> dict[str, str]:
        names = ("dp_noise_multiplier", "dp_target_epsilon", "dp_delta", "dp_clipping", "dp_noise", "dp_accountant",
                 "dp_target_quantile", "dp_clip_lr", "dp_count_noise")
        if self.dp_clip is None:
            return {name: "is read only with --dp-clip" for name in names}
        out = {"dp_noise_multiplier": "is chosen by --dp-target-epsilon"} if self.dp_target_epsilon is not None else {}
        if self.dp_target_quantile is None:
            out.update({name: "is read only with --dp-target-quantile" for name in ("dp_clip_lr", "dp_count_noise")})
        return out


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
    share = {p: 1 / len(layers) ** 0.5 if options.dp_clipping == "per_layer" else 1.0 for p in message.paths}
    adaptive = options.dp_target_quantile is not None
    count_noise = options.dp_count_noise or expected_clients / 20
    # adaptive clipping spends part of the budget on the count (Andrew et al. 2021, section 3.1): the update's
    # noise z_delta and the count's sigma_b together cost one Gaussian of multiplier z
    update_z = adaptive_update_noise(z, count_noise) if adaptive else z
    if adaptive:
        server_shape = jax.eval_shape(lambda v: algorithm.init(jax.random.key(0), v, context.num_clients)[0],
                                      jax.eval_shape(context.local.model.init, jax.random.key(0)))
        if not isinstance(server_shape, dict) or CLIP_KEY in server_shape:
            raise ValueError(f"--dp-target-quantile keeps the clip norm beside {name}'s server state, which must "
                             f"be a dict without a {CLIP_KEY!r} key")

    def clipped(changes, clip):
        """The changes within their bounds, the update's norm before clipping, and whether a bound bound."""
        squares = {p: jnp.sum(jnp.square(x.astype(jnp.float32))) for p, x in changes.items()}
        norm = jnp.sqrt(sum(squares.values()))
        if options.dp_clipping == "flat":
            over = {p: norm for p in changes}
        else:
            layer_norm = {layer: jnp.sqrt(sum(squares[p] for p in changes if _layer(p) == layer)) for layer in layers}
            over = {p: layer_norm[_layer(p)] for p in changes}
        scale = {p: jnp.minimum(1.0, clip * share[p] / jnp.maximum(over[p], 1e-30)) for p in changes}
        binding = jnp.any(jnp.stack([scale[p] < 1.0 for p in changes]))
        return {p: (x * scale[p]).astype(x.dtype) for p, x in changes.items()}, norm, binding

    def gaussian(tree, key, std):
        """N(0, std^2) shaped like every leaf of `tree`."""
        flat, structure = jax.tree_util.tree_flatten(tree)
        keys = jax.random.split(jax.random.fold_in(key, NOISE_STREAM), len(flat))
        draws = [(std * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) for k, x in zip(keys, flat)]
        return jax.tree_util.tree_unflatten(structure, draws)

    def private_upload(down, up, key, clip):
        changes, rest = message.split(up, down)
        changes, norm, binding = clipped(changes, clip)
        if options.dp_noise == "local" and update_z > 0:
            changes = jax.tree_util.tree_map(jnp.add, changes, gaussian(changes, key, update_z * clip))
            binding = jnp.bool_(True)
        # where no bound binds (and no noise is added) the upload as the algorithm made it, bit for bit
        sent = jax.tree_util.tree_map(lambda new, old: jnp.where(binding, new, old),
                                      message.rebuild(changes, rest, down), up)
        return sent, norm

    def client_update(down, state, data, key, info):
        up, state, metrics = algorithm.client_update(down, state, data, key, info)
        sent, norm = private_upload(down, up, key, clip)
        return sent, state, {**metrics, "update_norm": norm, "update_clipped": (norm > clip).astype(jnp.float32)}

    def private_server_update(server_state, ups, weights, info, clip):
        present = jnp.ones(weights.shape, bool) if info.participating is None else info.participating
        if info.participating is not None:
            # the mean over the K' present becomes the sum over K, the expected number (a fixed denominator)
            downs = jax.vmap(lambda c: algorithm.broadcast(server_state, c, info))(info.client_ids)
            changes, rest = message.split(ups, downs)
            factor = jnp.sum(present).astype(jnp.float32) / expected_clients
            ups = message.rebuild({p: (x * factor).astype(x.dtype) for p, x in changes.items()}, rest, downs)
        if options.dp_noise == "central" and update_z > 0:
            # one draw added to every slot: the mean the algorithm takes gains N(0, (z C)^2) / K
            one = jax.tree_util.tree_map(lambda x: x[0], ups)
            drawn = gaussian(one, info.server_key, update_z * clip / expected_clients)
            ups = jax.tree_util.tree_map(lambda x, d: x + d[None], ups, drawn)
        return algorithm.server_update(server_state, ups, present.astype(weights.dtype), info)

    if not adaptive:
        def server_update(server_state, ups, weights, info):
            return private_server_update(server_state, ups, weights, info, clip)

        return dataclasses.replace(algorithm, client_update=client_update, server_update=server_update,
                                   stale_upload=None)

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
        under = (norm <= down[CLIP_KEY]).astype(jnp.float32)  # client data too: the server noises its sum
        return {"update": sent, "under_clip": under}, state, {**metrics, "update_norm": norm,
                                                              "update_clipped": 1.0 - under,
                                                              "clip_norm": down[CLIP_KEY]}

    def adaptive_server_update(server_state, ups, weights, info):
        clip_now = server_state[CLIP_KEY]
        present = jnp.ones(weights.shape, bool) if info.participating is None else info.participating
        new, step_metrics = server_step(private_server_update(inner(server_state), ups["update"], weights, info,
                                                              clip_now))
        count = jnp.sum(jnp.where(present, ups["under_clip"], 0.0))
        if z > 0:
            count = count + count_noise * jax.random.normal(jax.random.fold_in(info.server_key, COUNT_STREAM))
        under = count / expected_clients  # the share of clients under the norm: it steps toward the quantile
        new = {**new, CLIP_KEY: clip_now * jnp.exp(-options.dp_clip_lr * (under - options.dp_target_quantile))}
        return ServerStep(new, step_metrics) if step_metrics else new

    return dataclasses.replace(algorithm, init=init, broadcast=broadcast, client_update=adaptive_client_update,
                               server_update=adaptive_server_update, stale_upload=None)
