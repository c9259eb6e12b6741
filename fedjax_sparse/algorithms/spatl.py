"""SPATL (Yu et al., CVPR 2023): a shared encoder, private predictors, gradient control on the encoder,
and uploads of the encoder's salient units aggregated by eq. 12.

Split (section 3.1). Every model names its encoder and predictor in its
structure description (`Layer.part`; e.g. ResNet-20/32: the three stages are
the encoder, the stem and the classifier stay private; models no paper splits:
hidden layers = encoder, output layer = predictor). A variable belongs to the
part of the layer that owns it (`core.structure.layer_groups.part_labels`): a layer's
kernel, bias and normalization, running statistics included. The server holds
only the encoder and its control variate c_g; a client holds its whole model
(its private parts and its last local encoder), its control variate c_l
(encoder-shaped, zeros at start), its last salient unit masks and its
selection policy's state. Private parts never leave the client.

Client (Algorithm 2). The received encoder replaces the client's own; one
LocalSGD run trains encoder and predictor together, the encoder's gradient
corrected by c_g - c_l (eq. 9; `gradient_control=False` drops it, section
4.6.1's ablation), the predictor's not. Then
    c_l+ = c_l - c_g + (w_g - w_e) / (a x lr)                                    (eq. 10)
The paper writes E (local epochs) for a; we read it as SCAFFOLD's option II
count the equation comes from, the number of local steps, momentum-aware
(`LocalSGD.effective_steps`, `building_blocks.control_variates`): divided by epochs, c_l
would be the sum of an epoch's gradients rather than their mean, ~steps-per-
epoch times too large for c to correct a gradient with.
The official code (`spatl_control=code`; federated_learning/network_training.py
at fef44a6, :459 and :479) applies the control otherwise: after each optimizer
step it subtracts lr (c_g - c_l) / 100 from the encoder (outside the momentum,
a hundredth of eq. 9's correction), and its c_l+ divides by the plain count of
steps; the same formula then gives c_l+ = the mean gradient + 0.99 (c_l - c_g).
benchmarks/results/parity.md compares both with the code.

Salient selection. A policy gives a keep ratio per encoder layer; within a
layer the units with the largest L2 norm of their incoming weights are kept
(`core.structure.unit_selection.keep_top_units`, a residual unit_group ranked by its
members' summed norms at the mean of their ratios). Policy `fixed`: one ratio
for every layer, `salient_keep`, or by default the largest uniform ratio whose
masks cut the encoder's FLOPs by at least `flops_reduction` (default 0.2, the
official code's target), counted with the inputs a pruned unit removes from its
consumers (`core.structure.flops`, count_inputs=True). Policy `agent`: each client's GNN-PPO
agent (`fedjax_sparse.agent`, `agent_policy`), rewarded by the accuracy of the
candidate sub-model on a held-out share of the client's own data (the paper's
"validation dataset"; `agent_validation_fraction`, kept out of local training):
a random, label-stratified share drawn once per client from its own stream
(`agent_holdout`), not the end of its data window, which in a class-ordered
image folder would be one class.

Messages. Down: the encoder (weights and BatchNorm statistics) and c_g, dense.
Up: the kept units' encoder values (their kernel entries from kept inputs,
biases, normalization parameters and statistics) as unit-structured sparse
leaves (`core.messages.pricing.unit_sparse`: the server learns which units were kept
from the message and pays, once per layer, the cheaper of a bitmask over the
layer's units and a list of their ids, as eq. 12 indexes filters), and the
control delta Delta c = c_l+ - c_l, dense (Algorithm 2 sends it whole).

Server. Eq. 12 as written, w_g <- w_g + eta (1/|K|) sum_k (w_g[i_k] - w_k),
moves the global encoder away from the clients; we read the sign that moves it
toward them (the paper's Fig. 3 and every other method of the family):
    w_g <- w_g + eta_g (1/|K|) sum_k M_k * (w_k - w_g)        (`eq12`, default; eta_g = --server-lr)
so an entry sent by few clients moves a fraction of the way. Options:
`masked_mean` (per entry, w_g + eta_g (mean over the clients that sent it - w_g))
and `fedavg` (what the official code does: clients send whole encoders, the
data-weighted mean replaces w_g). The step on the encoder's weights is the server
optimizer's (`building_blocks.server_optimizer`, on the mean delta of the rule: sgd at
--server-lr eta_g by default, i.e. the rules above; entries nobody sent keep their
value and optimizer state); its BatchNorm statistics, not gradients, take the rule's
result at eta_g = 1. Then c_g <- c_g + (1/N) sum_k Delta c_k (eq. 11).

Evaluation (section 4.4). Each client predicts with its salient sub-model: its
own last encoder run with its salient unit masks, and its own predictor
(`spatl_evaluation=dense`: the whole encoder). SPATL has no global model.
Under partial participation (fewer clients per round than clients) a client's
own encoder may be many rounds old, or the random initial one if it was never
sampled; there every client is evaluated with the current global encoder and
its own predictor (`evaluation_clients`), the salient masks taken on that
encoder at the share of units its policy last kept (all units if it never
chose), and a client that never trained gets a predictor fitted by eq. 4
(`fit_predictor`: its local epochs on its training data, the encoder frozen)
at each evaluation; nothing of it is written back to the client. With every
client sampled each round (the paper's setting) the own encoders are those of
the last round and are used as they are.
Logged each evaluation, over the clients sampled in the last round, each named for
what it measures: of the salient sub-model a client predicts with,
`inference_kept_weights` (its kept encoder parameters / all encoder parameters, mean:
Table 2's "sparsity"), the whole model's inference FLOPs reduction
(`inference_flops_reduction_mean`, `_max`: Table 2) and the encoder's
(`inference_encoder_flops_reduction_mean`); of what the client sent,
`upload_kept_weights` (the encoder parameters in its upload / all of them: the same
as the inference figure under eq12 and masked_mean, 1 under fedavg, where the whole
encoder travels).

Transfer (eq. 4, section 4.5): `fit_predictor` trains a new client's predictor
(and private parts) on a frozen encoder.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.agent import (GraphTemplate, load_agent)
from fedjax_sparse.core.messages.aggregation import masked_mean, present_only, uniform_mean, weighted_mean
from fedjax_sparse.core.contract.algorithm import AlgorithmSpec, BuildContext, FederatedAlgorithm, replicate
from fedjax_sparse.building_blocks.control_variates import control_update, corrected_gradients, server_control_update
from fedjax_sparse.core.structure.flops import layer_forward_flops
from fedjax_sparse.core.structure.model_parts import overlay, part_labels, take_part
from fedjax_sparse.core.round.local_training import LocalObjective, LocalSGD
from fedjax_sparse.core.messages.pricing import SparseArray, unit_sparse
from fedjax_sparse.core.contract.options import option
from fedjax_sparse.building_blocks.server_optimizer import ServerOptimizerOptions, from_options
from fedjax_sparse.core.structure.unit_masks import full_unit_masks, variable_masks
from fedjax_sparse.core.round.streams import stream_key
from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.algorithms.spatl_selection import (SalientPolicy, agent_holdout, agent_config, agent_policy,
                                                      dense_encoder_flops, encoder_layers, fixed_policy,
                                                      salient_masks, split_holdout, uniform_keep_ratio)

tree_map = jax.tree_util.tree_map
NEVER = -1  # a client's last round before it first trains
# federated_learning/network_training.py:459 of the official code: w -= lr (c_g - c_l) / 100 after each step
CODE_CONTROL_DIVISOR = 100.0


@dataclasses.dataclass(frozen=True)
class SPATLOptions(ServerOptimizerOptions):
    salient_policy: str = option("fixed", "SPATL: how each client picks its encoder layers' keep ratios: one "
                                          "ratio for all (fixed) or its learned GNN-PPO agent (agent)",
                                 choices=("fixed", "agent"))
    salient_keep: float | None = option(None, "SPATL fixed policy: keep this fraction of every encoder layer's "
                                              "units (default: the largest that meets --flops-reduction)",
                                        low=0.0, low_open=True, high=1.0)
    flops_reduction: float = option(0.2, "SPATL: the salient sub-model must cut the encoder's FLOPs by at "
                                         "least this fraction", low=0.0, high=1.0, high_open=True)
    spatl_aggregation: str = option("eq12", "SPATL: eq12 (masked deltas / |K|), masked_mean (per entry over "
                                            "its senders) or fedavg (whole encoders, data-weighted)",
                                    choices=("eq12", "masked_mean", "fedavg"))
    spatl_evaluation: str = option("salient", "SPATL: clients predict with their salient sub-model or their "
                                              "dense encoder", choices=("salient", "dense"))
    gradient_control: bool = option(True, "SPATL: correct the encoder's gradients by c_g - c_l (eq. 9)")
    spatl_control: str = option("paper", "SPATL: the control term as the paper reads it (paper: c_g - c_l added to "
                                         "the encoder's gradient, c_l+ over the momentum-aware step count) or as "
                                         "the official code applies it (code: lr (c_g - c_l) / 100 subtracted from "
                                         "the encoder after each optimizer step, c_l+ over the plain step count)",
                                choices=("paper", "code"))
    agent_updates: int = option(5, "SPATL agent: PPO updates of each client's agent per round (20 steps each)",
                                low=1)
    agent_reset: bool = option(False, "SPATL agent: a fresh agent every round (the official code) instead of "
                                      "continual learning")
    agent_init: str | None = option(None, "SPATL agent: start every client from this saved agent "
                                          "(agent.save_agent's file)")
    agent_validation_fraction: float = option(0.1, "SPATL agent: share of each client's data held out of local "
                                                   "training to score candidate sub-models (the reward)",
                                              low=0.0, low_open=True, high=1.0, high_open=True)
    agent_validation_examples: int = option(64, "SPATL agent: at most this many held-out examples score a "
                                                "candidate sub-model each round", low=1)

    def ignored(self) -> dict[str, str]:
        """Options the chosen policy (and server optimizer) does not read (`core.contract.options.refuse_ignored`)."""
        out = super().ignored()
        if self.salient_policy == "agent":
            out["salient_keep"] = ("is the fixed policy's keep ratio; --salient-policy agent searches its own "
                                   "(toward --flops-reduction)")
            return out
        out.update({f.name: "is a setting of the learned agent; --salient-policy fixed does not read it (add "
                            "--salient-policy agent)" for f in dataclasses.fields(self) if f.name.startswith("agent_")})
        if self.salient_keep is not None:
            out["flops_reduction"] = ("is not read when --salient-keep fixes the keep ratio (the fixed policy "
                                      "takes one or the other); give only one of them")
        return out


# ------------------------------------------------------------------ transfer (eq. 4)

def fit_predictor(local: LocalSGD, variables: dict, encoder: dict, data: ClientData, key: jax.Array) -> tuple[dict, dict]:
    """Eq. 4: a client's predictor (and private parts) trained on its data under a frozen `encoder`.

    `variables` is the client's model (its predictor's starting point); the encoder's weights
    and BatchNorm statistics stay exactly as given. Returns (variables, local training stats).
    """
    labels = part_labels(local.model)
    variables = overlay(variables, encoder)
    trainable = tree_map(lambda part: part != "encoder", labels)
    mask = tree_map(lambda keep, leaf: jnp.full(jnp.shape(leaf), keep), trainable, variables)
    return local.train(variables, data, key, objective=LocalObjective(update_mask=mask))


# ------------------------------------------------------------------ the algorithm

def spatl(context: BuildContext, options: SPATLOptions, policy: SalientPolicy | None = None) -> FederatedAlgorithm:
    local = context.local
    model = local.model
    structure = model.structure
    layers = encoder_layers(structure)
    labels = part_labels(model)
    num_clients = context.num_clients
    if policy is None and options.salient_policy == "agent":
        config = agent_config(options)
        initial = (load_agent(options.agent_init, GraphTemplate.from_structure(structure, layers), config)
                   if options.agent_init else None)
        policy = agent_policy(model, layers, options, config, initial)
    elif policy is None:
        ratio = options.salient_keep if options.salient_keep is not None else \
            uniform_keep_ratio(structure, layers, options.flops_reduction)
        policy = fixed_policy(layers, ratio)
    reads = [why for why, reads_train in (
        ("marks each client's held-out share for its agent on the whole training split", policy.holdout > 0),
        ("fits predictors for never-sampled clients on their training data at each evaluation (partial "
         "participation)", context.clients_per_round < num_clients)) if reads_train]
    train = context.device_train("spatl", " and ".join(reads), "--salient-policy fixed with --clients-per-round "
                                                               "equal to --num-clients") if reads else None
    held = agent_holdout(train, policy.holdout, context.seed) if policy.holdout else None
    dense_flops = float(sum(layer_forward_flops(structure).values()))
    dense_encoder = dense_encoder_flops(structure, layers)
    encoder_weights = float(sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(
        take_part(jax.eval_shape(model.init, jax.random.key(0)), labels, "encoder")["params"])))
    is_sparse = lambda x: isinstance(x, SparseArray)  # noqa: E731
    server = from_options(options)

    def encoder_of(variables):
        return take_part(variables, labels, "encoder")

    def init_clients(key, variables, ids):
        m = len(ids)
        zeros = tree_map(jnp.zeros_like, encoder_of(variables)["params"])
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(ids))
        return {"variables": replicate(variables, m), "control": replicate(zeros, m),
                "salient": replicate(full_unit_masks(structure), m), "policy": jax.vmap(policy.init)(keys),
                "last_round": jnp.full((m,), NEVER, jnp.int32)}

    def init(key, variables, n):
        if n != num_clients:
            raise ValueError(f"SPATL was built for {num_clients} clients, init got {n}")
        encoder = encoder_of(variables)
        zeros = tree_map(jnp.zeros_like, encoder["params"])
        return {**server.init_state(encoder, key="encoder"), "control": zeros,
                "round": jnp.asarray(NEVER, jnp.int32)}, init_clients(key, variables, jnp.arange(n))

    def client_update(down, state, data, key, info):
        variables = overlay(state["variables"], down["encoder"])
        c_g, c_l = down["control"], state["control"]

        def correct(grads):
            encoder_grads = take_part(grads["params"], labels["params"], "encoder")
            return {**grads, "params": overlay(grads["params"], corrected_gradients(encoder_grads, c_g, c_l))}

        def code_correction(before, after, batch):  # the official code's step: after the optimizer's, / 100
            lr = local.learning_rate_at(info.index)
            encoder = take_part(after["params"], labels["params"], "encoder")
            moved = tree_map(lambda w, g, l: w - lr * (g - l) / CODE_CONTROL_DIVISOR, encoder, c_g, c_l)
            return {**after, "params": overlay(after["params"], moved)}, {}

        # training draws from `key` exactly as every other method does; the policy from a branch of it
        policy_key = jax.random.fold_in(key, 1)
        code = options.spatl_control == "code"
        objective = LocalObjective(
            grad_correction=correct if options.gradient_control and not code else None,
            after_step=code_correction if options.gradient_control and code else None)
        training, validation = split_holdout(data, held)
        trained, stats = local.train(variables, training, key, round_index=info.index, objective=objective)
        encoder = encoder_of(trained)
        # the code divides by its count of steps, whatever the momentum (the paper's reading: FedNova's count)
        counted = dataclasses.replace(local, momentum=0.0) if code else local
        new_control = control_update(counted, c_l, c_g, down["encoder"]["params"], encoder["params"],
                                     stats["num_steps"], info.index)
        policy_state, ratios, policy_metrics = policy.select(state["policy"], trained, validation, policy_key)
        masks = salient_masks(structure, trained["params"], ratios, layers)
        # priced per layer as its kept units' index once plus the values (core.messages.pricing.unit_sparse);
        # fedavg sends every unit, which prices as the dense encoder
        sent = encoder_of(unit_sparse(structure, trained,
                                      full_unit_masks(structure) if options.spatl_aggregation == "fedavg" else masks))
        up = {"encoder": sent, "control_delta": tree_map(jnp.subtract, new_control, c_l)}
        new_state = {"variables": trained, "control": new_control, "salient": masks, "policy": policy_state,
                     "last_round": info.index}
        return up, new_state, {**stats, **policy_metrics}

    def server_update(server_state, ups, weights, info):
        # |K| and every sum: the clients taking part (`RoundInfo.participating`); an absent one sent nothing
        participating = info.participating
        values = tree_map(lambda s: s.values, ups["encoder"], is_leaf=is_sparse)
        masks = present_only(tree_map(lambda s: s.mask.astype(jnp.float32), ups["encoder"], is_leaf=is_sparse),
                             participating)
        old = server_state["encoder"]
        held = None
        if options.spatl_aggregation == "fedavg":
            target = weighted_mean(values, weights)
        else:  # the rule's result at eta_g = 1; the server optimizer takes the step (eta_g = --server-lr)
            held = tree_map(lambda m: jnp.any(m > 0, axis=0), masks)
            if options.spatl_aggregation == "eq12":
                target = tree_map(lambda w, mean: w + mean, old,
                                  uniform_mean(tree_map(lambda w, v, m: m * (v - w), old, values, masks),
                                               participating))
            else:  # masked_mean: toward each entry's mean over the clients that sent it
                target = masked_mean(values, masks, jnp.ones_like(weights), old)
        state = server.step_toward(server_state, target, held, key="encoder")
        return {**state, "control": server_control_update(server_state["control"], ups["control_delta"],
                                                          num_clients, participating),
                "round": info.index}

    def client_variables(server_state, state):
        if options.spatl_evaluation == "dense":
            return state["variables"]
        return {**state["variables"], "unit_masks": state["salient"]}

    def kept_share(variables, masks):
        kept = encoder_of(variable_masks(structure, variables, masks))["params"]
        return sum(jnp.sum(m) for m in jax.tree_util.tree_leaves(kept)) / encoder_weights

    @jax.jit
    def client_diagnostics(server_state, client_states):
        def one(variables, masks):
            per_layer = layer_forward_flops(structure, masks, count_inputs=True)
            sent = full_unit_masks(structure) if options.spatl_aggregation == "fedavg" else masks
            return (kept_share(variables, masks), kept_share(variables, sent),
                    1.0 - sum(per_layer.values()) / dense_flops,
                    1.0 - sum(per_layer[n] for n in layers) / dense_encoder)

        kept, sent, reduction, encoder_reduction = jax.vmap(one)(client_states["variables"], client_states["salient"])
        return {"kept": kept, "sent": sent, "reduction": reduction, "encoder_reduction": encoder_reduction,
                "uploaded": client_states["last_round"] == server_state["round"]}  # the last round's senders

    def diagnostics(server_state, figures):
        uploaded = figures["uploaded"]

        def mean(values):
            return float(np.sum(np.where(uploaded, values, 0.0)) / max(int(np.sum(uploaded)), 1))

        return {"inference_kept_weights": mean(figures["kept"]), "upload_kept_weights": mean(figures["sent"]),
                "inference_flops_reduction_mean": mean(figures["reduction"]),
                "inference_flops_reduction_max": float(np.max(np.where(uploaded, figures["reduction"], -np.inf))),
                "inference_encoder_flops_reduction_mean": mean(figures["encoder_reduction"])}

    fit_key = stream_key(context.seed, "predictor_fit")

    @jax.jit
    def evaluation_clients(server_state, client_states):
        encoder = server_state["encoder"]

        def one(args):
            state, client = args

            def fitted():  # eq. 4: a predictor for a client that never trained one
                training, _ = split_holdout(train.client(client), held)
                return fit_predictor(local, state["variables"], encoder, training,
                                     jax.random.fold_in(fit_key, client))[0]

            variables = jax.lax.cond(state["last_round"] == NEVER, fitted,
                                     lambda: overlay(state["variables"], encoder))
            ratios = {name: jnp.mean(state["salient"][name]) for name in layers}
            return {"variables": variables, "salient": salient_masks(structure, variables["params"], ratios, layers)}

        # one client at a time, so that only never-trained clients pay for the fit
        return jax.lax.map(one, (client_states, jnp.arange(num_clients)))

    return FederatedAlgorithm(
        name="spatl",
        init=init,
        init_clients=init_clients,
        broadcast=lambda server_state, client_id, info: {"encoder": server_state["encoder"],
                                                         "control": server_state["control"]},
        client_update=client_update,
        server_update=server_update,
        client_variables=client_variables,
        global_variables=None,
        client_diagnostics=client_diagnostics,
        diagnostics=diagnostics,
        evaluation_clients=evaluation_clients if context.clients_per_round < num_clients else None,
    )


SPEC = AlgorithmSpec("spatl", SPATLOptions, spatl,
                     "SPATL: shared encoder, private predictors, encoder gradient control, salient uploads")
