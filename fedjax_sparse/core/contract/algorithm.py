"""The algorithm contract: a few pure functions over pytrees, and how an algorithm is built.

Modelled on optax's `(init, update)` pairs and fedjax's `FederatedAlgorithm`.
The engine (`core.round.step`) vmaps `broadcast` and `client_update` over the sampled
clients and jits the whole round; an algorithm owns only its math.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.core.federation.clock import DeviceProfile
from fedjax_sparse.core.round.local_training import LocalSGD
from fedjax_sparse.data.federated import ClientData, FederatedSplit

ServerState = Any
ClientState = Any
Message = Any
Variables = dict


@flax.struct.dataclass
class RoundInfo:
    """What the engine tells an algorithm about the round it is in (the same for all its clients).

    index: the round (int32 scalar, from 0); client_ids: the sampled clients, sorted ([K]);
    server_key: the server's randomness for the round (its own stream, see `core.round.step`);
    participating: None where every slot takes part (the uniform sampler, no stragglers: known when the
    round is built); else [K] bool, False for a slot whose client is absent from what is being computed
    (not sampled this round, failed, or late: `core.round.step.RoundConditions`). Such a slot's weight is 0.
    `select_uploads` and `server_update` must then compute what they compute without its slot at all
    (tests/test_participation_algorithms.py checks every shipped algorithm); `aggregation.uniform_mean`,
    `present_sum` and `present_only` do the reductions over the present.
    """

    index: jax.Array
    client_ids: jax.Array
    server_key: jax.Array
    participating: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
    """A federated algorithm as pure functions.

    init(key, variables, num_clients) -> (server_state, client_states)
        `variables` are the initial model variables; client states carry a
        leading [num_clients] axis (use `replicate`). An algorithm whose clients keep no state
        returns `{}` for them (a pytree without leaves; `init_clients` stays None); its
        `client_update` then receives `{}` and returns it.
    init_clients(key, variables, client_ids) -> client_states [len(client_ids), ...], optional
        the initial states of these clients alone, a pure function of (key, id) so that it
        does not depend on how many clients there are (`fold_in(key, id)`, never
        `split(key, N)`); `init`'s client states are `init_clients(key, variables, arange(N))`.
        The host and disk client stores (`core.client_state.store`) call it for clients they never
        wrote, so 10^6 clients cost nothing until sampled. None: the algorithm keeps no
        per-client state (`init`'s client states have no leaves).
    broadcast(server_state, client_id, info) -> down_message
        exactly what the server sends to one sampled client.
    client_update(down_message, client_state, data, key, info) -> (up_message, client_state, metrics)
        data: the client's examples (`data.federated.ClientData`; `LocalSGD.train` gathers them
        into `Batch`es of `x`, `y` and `mask`); key: the client's randomness for the round;
        metrics: a dict of scalars, at least 'loss' and 'num_steps'.
    server_update(server_state, up_messages, weights, info) -> server_state, or `ServerStep`
        up_messages stacked on a leading [K] axis in the order of info.client_ids;
        weights: the sampled clients' numbers of training examples, 0 for a slot absent from the
        aggregate (`RoundInfo.participating`): the result must equal the round without that slot.
        Returning `ServerStep(state, metrics)` also logs the metrics (scalars) every round.
    client_variables(server_state, client_state) -> the variables a client predicts with
        (may hold 'unit_masks': the client's sub-model).
    global_variables(server_state) -> variables, or None when there is no global model.
    global_variants(server_state) -> {name: variables}, optional (with global_variables)
        other versions of the global model scored beside it on the test set, logged as
        `test_accuracy_<name>` (FedPM's mask thresholded at 0.5 beside its sampled one).
    select_uploads(up_messages, weights, info) -> up_messages, optional
        for methods where the server tells clients what to upload after seeing
        their feedback (FedLDF): returns what is really sent, which is what the
        uplink bytes are counted on and what server_update receives.
    client_diagnostics(server_state, client_states) -> dict of per-client figures, optional
        each a [M] array (or a dict of them) over the M clients given (traceable); the engine
        takes them chunk by chunk and process by process where the client states live off
        the device (`core.client_state.store`), so nothing here may look at another client.
    diagnostics(server_state, figures) -> dict of scalars, optional (with client_diagnostics)
        the extra figures logged with each evaluation (density, FLOPs, ...), from every
        client's `client_diagnostics` as numpy arrays in client-id order.
    evaluation_state(server_state) -> server_state, optional
        what the evaluations read instead of the server state itself (HeteroFL's
        static BatchNorm recomputes the global model's statistics first); called
        once per evaluation, never inside a round.
    evaluation_clients(server_state, client_states) -> stacked per-client states, optional
        what the personalized evaluation hands `client_variables` instead of the
        client states (SPATL under partial participation: every client with the
        current global encoder, a predictor fitted for those that never trained);
        called once per evaluation, never inside a round, and never written back.
    stale_upload: `StaleUpload`, optional: the algorithm's server takes an upload trained from an
        older broadcast (asynchronous rounds, `core.round.buffered`); None: it runs synchronously only.
    aggregates_mean: True where `server_update` reads the uploads only through their mean over the
        slots taking part (each leaf's, whatever the weights), so that a server given every slot the
        same mean computes what it computes from the uploads themselves: the privatized mean of
        differential privacy, the sum that secure aggregation reveals. False: it needs each upload.
    private_sum: `PrivateSum`, optional: how a server that does not read its uploads through their plain mean
        (`aggregates_mean` False) still reads them through sums of the clients' changes whose movement by one
        client is bounded (FedLDF's per-layer choice, a compressed upload), so that differential privacy can
        noise them (`privacy.mechanism`); None: it cannot (or it reads the plain mean).
    steps_when_empty: True where `server_update` must run in a round no client returned (differential
        privacy's noise is added whatever took part: an unchanged model would tell that nobody did); False:
        such a round leaves the server state as it was (`core.round.step.server_phase`).
    client_metric_stats: ((metric, statistics), ...), optional: what a round logs of the algorithm's per-client
        metrics besides their means over the clients (('reward', ('min', 'p90')),: 'min', 'max', 'std', 'pN';
        `run.client_metrics`), on top of the run's `--client-metric-stats` (pairs, not a dict: an algorithm is
        hashable).
    """

    name: str
    init: Callable[[jax.Array, Variables, int], tuple[ServerState, ClientState]]
    broadcast: Callable[[ServerState, jax.Array, RoundInfo], Message]
    client_update: Callable[[Message, ClientState, ClientData, jax.Array, RoundInfo],
                            tuple[Message, ClientState, dict]]
    server_update: Callable[[ServerState, Message, jax.Array, RoundInfo], ServerState]
    client_variables: Callable[[ServerState, ClientState], Variables]
    global_variables: Callable[[ServerState], Variables] | None = None
    global_variants: Callable[[ServerState], dict[str, Variables]] | None = None
    init_clients: Callable[[jax.Array, Variables, jax.Array], ClientState] | None = None
    select_uploads: Callable[[Message, jax.Array, RoundInfo], Message] | None = None
    client_diagnostics: Callable[[ServerState, ClientState], dict] | None = None
    diagnostics: Callable[[ServerState, dict], dict] | None = None
    evaluation_state: Callable[[ServerState], ServerState] | None = None
    evaluation_clients: Callable[[ServerState, ClientState], ClientState] | None = None
    stale_upload: "StaleUpload | None" = None
    aggregates_mean: bool = False
    private_sum: "PrivateSum | None" = None
    steps_when_empty: bool = False
    client_metric_stats: tuple[tuple[str, tuple[str, ...]], ...] = ()


@flax.struct.dataclass
class ServerStep:
    """What `server_update` may return instead of the new server state alone: `state`, the new state, and
    `metrics`, a dict of scalar metrics of the step (a server learning rate it chose, a norm), logged every round
    as `server_<name>`."""

    state: Any
    metrics: dict


def server_step(out: Any) -> tuple[Any, dict]:
    """(new server state, the step's metrics) of what `server_update` returned."""
    return (out.state, out.metrics) if isinstance(out, ServerStep) else (out, {})


@dataclasses.dataclass(frozen=True)
class StaleUpload:
    """How an upload trained from an older broadcast joins a later aggregate (`core.round.buffered`).

    increment(up, down) -> what the client's training added to what it received (a pytree of floats);
    rebase(increment, down_now) -> the upload the client would have sent, had its training added
    `increment` to `down_now`. The server then aggregates rebased uploads as it aggregates fresh ones;
    an algorithm whose server cannot read an upload so (its uploads are not increments of what it sent:
    a client-chosen layer or mask, a count) leaves `stale_upload` None and is refused asynchronous rounds.
    unweighted: keys of the increment (a dict) that count whole whatever their staleness, where the
    client keeps the whole change as its own state (SCAFFOLD's control delta: the server's c stays the mean
    of the clients' c_i only if it adds what each c_i added); the rest is weighted by s(tau)."""

    increment: Callable[[Message, Message], Any]
    rebase: Callable[[Any, Message], Message]
    unweighted: tuple[str, ...] = ()


def _subtract(up, down):
    return jax.tree_util.tree_map(lambda u, d: u.astype(jnp.float32) - d.astype(jnp.float32), up, down)


def _add(increment, down):
    return jax.tree_util.tree_map(lambda i, d: (d.astype(jnp.float32) + i).astype(d.dtype), increment, down)


# the upload is the client's trained copy of the model it received (FedAvg, FedProx)
MODEL_UPLOAD = StaleUpload(_subtract, _add)


@dataclasses.dataclass(frozen=True)
class PrivateSum:
    """What client-level differential privacy must know of a server whose aggregate is made of sums of the
    clients' released changes, each clipped to L2 norm C (a server reading the plain mean is the default:
    `PrivateSum()`). The algorithm's file states why its figures hold.

    sensitivity: how far, in L2 and in units of C, adding or removing one client can move those sums
        taken together (1 for a plain sum: the client's own change);
    replace_sensitivity: the same for replacing one client's data (2 for a plain sum);
    clip_layers: (upload path, layer) pairs over the released leaves, where the bound holds only with each
        layer clipped on its own to C / sqrt(layers) (FedLDF: its selection units); None: any clipping;
    denominator: None: each entry's mean is over the slots taking part, a sparse leaf counting as zeros where
        it sends nothing (a compressed message: the server must then accept the dense array in place of the
        sparse leaf, what it stands for); n: each entry's mean is over the uploads whose sparse leaf carries
        it (a masked mean), which privacy makes a sum over the fixed count n;
    feedback: upload paths (or their prefixes) the server reads only to choose what it aggregates, which it
        never releases: neither clipped nor noised (FedLDF's divergences);
    references: (upload prefix, broadcast prefix) pairs: an upload leaf under the first is the new value of
        the broadcast's leaf at the same rest of the path under the second, where one of its shape and dtype
        is there, and its change is what is clipped; any other released leaf is a change already.
    """

    sensitivity: float = 1.0
    replace_sensitivity: float = 2.0
    clip_layers: tuple[tuple[str, str], ...] | None = None
    denominator: int | None = None
    feedback: tuple[str, ...] = ()
    references: tuple[tuple[str, str], ...] = (("", ""),)


class NeedsDeviceData(ValueError):
    """An algorithm, as configured, reads every client's data on the device, and the run keeps them off it."""


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a run gives an algorithm's builder besides its options.

    local: the local trainer (`LocalSGD`: model, optimizer, epochs, batch size);
    num_clients: N, the clients of the federation (the leading axis of `init`'s client states);
    clients_per_round: K, the slots of a round: the leading axis of the uploads `server_update` gets
      (`--clients-per-round`; more with `--over-selection`, or a sampler's own slot count, `core.federation.participation`);
    num_classes: the data set's number of labels (the model's outputs);
    train: every client's training data on the device (methods whose server needs
      facts about the clients' data, e.g. FedGSE's public set and its clients' label
      answers), or None where the run keeps them off the device (host and disk client
      stores, several processes): such methods take it through `device_train`;
    seed: the run's seed (for randomness fixed at build time);
    labels_per_client: the partition's labels per client, when it has one;
    device_profile, round_deadline: the clients' devices and the round's deadline in simulated
      seconds (`--device-profile`, `--round-deadline`), where the run has them (the sub-models'
      `--capacity-from device` sizes each client's sub-model by them);
    train_counts: [num_clients] each client's training examples, where the run gives them
      (else `train`'s counts, where it is there).
    """

    local: LocalSGD
    num_clients: int
    clients_per_round: int
    train: FederatedSplit | None
    num_classes: int
    seed: int = 0
    labels_per_client: int | None = None
    device_profile: DeviceProfile | None = None
    round_deadline: float | None = None
    train_counts: np.ndarray | None = dataclasses.field(default=None, compare=False, hash=False)

    def device_train(self, algorithm: str, why: str, otherwise: str = "") -> FederatedSplit:
        """`train`, for a method that reads every client's data on the device (`why`: what for);
        `NeedsDeviceData` where the run keeps them off it. `otherwise`: the method's options
        that would not read them, named in the error."""
        if self.train is None:
            raise NeedsDeviceData(f"--algorithm {algorithm} {why}, which needs every client's data on one device: "
                                  f"run it with --client-store device (or auto) in one process"
                                  + (f", or {otherwise}" if otherwise else ""))
        return self.train


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """A named algorithm: its options dataclass (declared beside its math) and its builder."""

    name: str
    options: type
    build: Callable[[BuildContext, Any], FederatedAlgorithm]
    summary: str = ""


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """For algorithms without options of their own."""


def replicate(tree: Any, num_clients: int) -> Any:
    """Stacks `num_clients` copies of `tree` on a new leading axis."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients, *jnp.shape(x))), tree)
