"""FedLDF (Wang et al., 2024): each layer is uploaded only by the clients whose layer moved most.

Per round (paper section II.A, Algorithm 1):
  1. the server broadcasts the global model (downlink as FedAvg);
  2. the K sampled clients train locally exactly as in FedAvg (`LocalSGD.train`);
  3. each computes its divergence vector, one float32 per layer l:
     ||Theta_{k,l} - Theta_hat_l||_2 over all the layer's trainable parameters
     (eq. 3; see `core.structure.layer_groups` for the grouping and the norm), and sends
     it (L floats; counted in the uplink);
  4. the server (`select_uploads`) takes, per layer, the n clients with the
     largest divergence (eq. 4), and only they upload that layer: the up
     message's variables become `SparseArray`s whose mask is that per-layer
     selection, so a layer sent costs its dense bytes and a layer not sent
     costs nothing;
  5. each layer is the data-size-weighted mean over its n senders (eqs. 5, 6),
     via `masked_mean`; a layer nobody sent (impossible with n >= 1) would
     keep the previous global value.

Uplink per round = sum_l n * bytes(layer l) + K * L * 4, i.e. n model copies
plus the feedback. A "layer" is one structure layer with its bias and its
normalization (BN scale/bias and running mean/var travel with their conv).

Ties in eq. 4 are broken deterministically: among equal divergences the client
earlier in the round's (sorted) client order wins.

Baselines of the paper's section III:
  `fedldf_random` -- the same per-layer upload pattern (n clients per layer, same
    bytes) with the n drawn uniformly at random per layer from the server's
    round key. Its clients still send the divergence vector, so its bytes equal
    FedLDF's exactly and only the choice rule differs (the paper says the two
    have the same communication overhead).
  `hdfl` -- HDFL-style client dropping: a random n of the K clients upload
    their whole model and the server takes the data-size-weighted mean of
    those. The paper's HDFL has no layer feedback, so its clients send no
    divergence: uplink = n * model bytes.

n = K is FedAvg (every client uploads every layer; the mean is the same
data-size-weighted mean, up to float rounding of a different summation).
The server steps toward the per-layer means with its optimizer
(`building_blocks.server_optimizer`; sgd at lr 1 by default: the means replace the layers).

Where participation varies (`RoundInfo.participating`), every choice is made among the clients
taking part: an absent client never uploads a layer, and a layer goes to min(n, present) clients.
FedLDF's ranking then is exactly the ranking of a round without the absent clients. The random
baselines draw among the present too, each n-subset of them equally likely, as in such a round; but
their draw is over the round's K slots, so it is not the same draw as a round of the present alone
(the same only where n >= the clients present, when every one of them uploads).

Under client-level differential privacy (`--dp-clip C`, `privacy.mechanism`), FedLDF
declares its sums (`PrivateSum`); the wrapper clips each client's layers, noises, and counts every
client equally. What the server releases is, per layer l, s_l = the sum over its chosen set Sel_l of the
clients' clipped changes of layer l, plus Gaussian noise, over the fixed n (not min(n, clients present):
a count that depended on who took part would need privacy too). Its sensitivity, each layer clipped to
C / sqrt(L) (so a client's whole change is within C):
  * adding a client x changes each Sel_l by at most x in and one client d_l out (x ranks among the others
    as it would, their order unchanged; fewer than n present: x in, nobody out), so s_l moves by
    a_l - b_l with a_l x's layer or 0 and b_l d_l's layer or 0. Over all layers,
    ||a|| <= sqrt(sum_l C^2 / L) = C and ||b|| <= C as well, although the d_l differ from layer to
    layer, since each is one layer of one client: the sums move by at most 2 C (removing: the same);
  * replacing x by x' moves s_l by a_l - b_l with a_l one of x's layer, d_l's layer or 0 and b_l one of
    x''s layer, d_l's layer or 0: 2 C again (twice a plain sum's C, as the accountant counts a
    replaced client, so no more noise than FedAvg's there).
Flat clipping gives no such bound: the displaced clients' layers could each carry all of their C, up to
C sqrt(L) together; it is refused (`--dp-clipping per_layer`, over these layers: each is one of this
module's layers, with its bias and normalization). The divergences choose Sel_l and are never released
(the server is trusted: central noise); noise on each client (`--dp-noise local`) would leave them bare
and is refused, as secure aggregation is (the choice needs each client's divergence). The divergences are
those of the unclipped changes, so the choice ranks the clients as FedLDF does. The random baselines
declare nothing (their draw over the slots moves when a client is added) and are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from fedjax_sparse.algorithms.fedavg import fedavg
from fedjax_sparse.core.messages.aggregation import masked_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, FederatedAlgorithm, PrivateSum
from fedjax_sparse.core.structure.layer_groups import LayerGroups, model_layer_groups
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.core.messages.pricing import SparseArray
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizer, ServerOptimizerOptions, from_options, server_optimizer
from fedjax_sparse.core.contract.wrapping import flat_leaves

tree_map = jax.tree_util.tree_map


@dataclasses.dataclass(frozen=True)
class FedLDFOptions(ServerOptimizerOptions):
    clients_per_layer: int = option(4, "n, the clients that upload each layer (FedLDF's top-n; "
                                       "fedldf_random's and hdfl's random n); in [1, --clients-per-round]")


def check_clients_per_layer(clients_per_layer: int, clients_per_round: int, name: str = "fedldf") -> None:
    """n must be in [1, K]: raised when the algorithm is built, before any training."""
    if not 1 <= clients_per_layer <= clients_per_round:
        raise ValueError(f"{name}: --clients-per-layer n={clients_per_layer} is outside the valid range "
                         f"[1, {clients_per_round}] (1 to --clients-per-round K={clients_per_round})")


def top_n_per_layer(scores: jax.Array, n: int) -> jax.Array:
    """[K, L] scores -> [K, L] bool, True for the n largest scores of each column (eq. 4).

    A stable sort on the negated scores puts, among equal scores, the lower
    client index first, so ties are broken deterministically.
    """
    order = jnp.argsort(-scores, axis=0, stable=True)  # [K, L]: clients by decreasing score
    ranks = jnp.argsort(order, axis=0, stable=True)   # rank of each client within its layer
    return ranks < n


def top_n_present(scores: jax.Array, n: int, participating: jax.Array | None) -> jax.Array:
    """`top_n_per_layer` over the clients taking part ([K] bool, `RoundInfo`; None: all): an absent client
    ranks below every present one and is never chosen, so the present are ranked as in a round without it
    (fewer than n present: all of them)."""
    if participating is None:
        return top_n_per_layer(scores, n)
    present = participating.reshape((-1,) + (1,) * (scores.ndim - 1))
    return top_n_per_layer(jnp.where(present, scores, -jnp.inf), n) & present


def random_n_per_layer(key: jax.Array, num_clients: int, num_layers: int, n: int,
                       participating: jax.Array | None = None) -> jax.Array:
    """[K, L] bool with exactly n True per column (min(n, present) among the clients taking part), each
    n-subset equally likely."""
    return top_n_present(jax.random.uniform(key, (num_clients, num_layers)), n, participating)


def random_n_clients(key: jax.Array, num_clients: int, n: int, participating: jax.Array | None = None) -> jax.Array:
    """[K] bool with exactly n True (min(n, present) among the clients taking part), each n-subset equally
    likely."""
    return top_n_present(jax.random.uniform(key, (num_clients, 1)), n, participating)[:, 0]


def _sparsify(variables, masks):
    return tree_map(SparseArray, variables, masks)


def _is_sparse(x) -> bool:
    return isinstance(x, SparseArray)


def _masked_aggregate(server: ServerOptimizer, server_state, sparse_variables, weights):
    """Per entry, the data-size-weighted mean over the clients that sent it (eq. 5), and the
    server's step toward it (every entry has senders: n >= 1 per layer)."""
    values = tree_map(lambda s: s.dense(), sparse_variables, is_leaf=_is_sparse)
    masks = tree_map(lambda s: s.mask, sparse_variables, is_leaf=_is_sparse)
    return server.step_toward(server_state, masked_mean(values, masks, weights, server_state["variables"]))


def _layer_upload_algorithm(name: str, local: LocalSGD, groups: LayerGroups,
                            choose: Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array],
                            server: ServerOptimizer | None) -> FederatedAlgorithm:
    """FedLDF's round with a pluggable per-layer choice `choose(divergences [K, L], key, participating)
    -> [K, L] bool`, which never chooses a client absent from the round (`RoundInfo.participating`).

    FedAvg's round with the divergence feedback added to the upload, the
    server's per-layer choice of what is really sent, and the masked mean.
    """
    server = server or server_optimizer()
    base = fedavg(local, server=server)

    def client_update(down, client_state, data, key, info):
        variables, client_state, stats = base.client_update(down, client_state, data, key, info)
        up = {"divergence": groups.divergence(variables, down), "variables": variables}
        return up, client_state, stats

    def select_uploads(ups, weights, info):
        del weights  # eq. 4 ranks by divergence only; the data sizes enter the mean (eq. 5)
        selection = choose(ups["divergence"], info.server_key, info.participating)
        masks = groups.expand(selection, ups["variables"])
        return {"divergence": ups["divergence"], "variables": _sparsify(ups["variables"], masks)}

    def server_update(server_state, ups, weights, info):
        return _masked_aggregate(server, server_state, ups["variables"], weights)

    return dataclasses.replace(base, name=name, client_update=client_update, server_update=server_update,
                               select_uploads=select_uploads, stale_upload=None,
                               aggregates_mean=False)


def fedldf(local: LocalSGD, clients_per_layer: int, clients_per_round: int,
           server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    """FedLDF: per layer, the n = `clients_per_layer` clients of largest divergence upload it."""
    check_clients_per_layer(clients_per_layer, clients_per_round, "fedldf")
    groups = model_layer_groups(local.model)
    n = clients_per_layer
    algorithm = _layer_upload_algorithm("fedldf", local, groups, lambda divergence, key, participating: top_n_present(
        divergence, n, participating), server)
    # differential privacy: the sums of the chosen layers move by 2 C per client, clipped per layer (the module
    # docstring); each layer's mean is over the fixed n; the divergences only choose
    layers = tuple((f"variables/{path}", groups.names[l]) for path, l in flat_leaves(groups.index).items())
    return dataclasses.replace(algorithm, private_sum=PrivateSum(
        sensitivity=2.0, replace_sensitivity=2.0, clip_layers=layers, denominator=n, feedback=("divergence",),
        references=(("variables", ""),)))


def fedldf_random(local: LocalSGD, clients_per_layer: int, clients_per_round: int,
                  server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    """The paper's "random" baseline: per layer, n clients drawn at random upload it (FedLDF's bytes).

    Drawn among the clients taking part, over the round's K slots: with a slot absent, not the draw of a
    round of the others alone (the same where n >= the clients present; the module docstring)."""
    check_clients_per_layer(clients_per_layer, clients_per_round, "fedldf_random")
    groups = model_layer_groups(local.model)
    n = clients_per_layer

    def choose(divergence, key, participating):
        k, num_layers = divergence.shape
        return random_n_per_layer(key, k, num_layers, n, participating)

    return _layer_upload_algorithm("fedldf_random", local, groups, choose, server)


def hdfl(local: LocalSGD, clients_per_layer: int, clients_per_round: int,
         server: ServerOptimizer | None = None) -> FederatedAlgorithm:
    """HDFL-style client dropping: a random n of the K clients upload the whole model; no feedback.

    Drawn among the clients taking part, over the round's K slots: with a slot absent, not the draw of a
    round of the others alone (the same where n >= the clients present; the module docstring)."""
    check_clients_per_layer(clients_per_layer, clients_per_round, "hdfl")
    n = clients_per_layer

    def select_uploads(ups, weights, info):
        del weights
        k = jax.tree_util.tree_leaves(ups)[0].shape[0]
        chosen = random_n_clients(info.server_key, k, n, info.participating)
        masks = tree_map(lambda x: jnp.broadcast_to(chosen.reshape((k,) + (1,) * (x.ndim - 1)), x.shape), ups)
        return _sparsify(ups, masks)

    server = server or server_optimizer()
    base = fedavg(local, server=server)
    return dataclasses.replace(base, name="hdfl",
                               server_update=lambda server_state, ups, weights, info: _masked_aggregate(
                                   server, server_state, ups, weights),
                               select_uploads=select_uploads, stale_upload=None,
                               aggregates_mean=False)


def _spec(name: str, builder, summary: str) -> AlgorithmSpec:
    return AlgorithmSpec(name, FedLDFOptions, lambda ctx, o: builder(ctx.local, o.clients_per_layer,
                                                                     ctx.clients_per_round, from_options(o)),
                         summary)


SPECS = (
    _spec("fedldf", fedldf, "FedLDF: per layer, the n clients that moved most upload it"),
    _spec("fedldf_random", fedldf_random, "FedLDF's baseline: n random clients upload each layer"),
    _spec("hdfl", hdfl, "HDFL-style dropping: n random clients upload whole models"),
)
