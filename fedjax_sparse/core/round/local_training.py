"""Local training as one loop over a client's steps, with exact epochs.

A client with n examples takes ceil(n / B) steps per epoch. Clients of
different sizes vmap together: the vmapped loop runs the busiest sampled
client's number of steps and a padded step leaves a client's carry unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.data.federated import (Batch, ClientData, client_batch, epoch_permutations,
                                          steps_per_epoch)
from fedjax_sparse.models.structure import Model

Carry = Any
StepFn = Callable[[Carry, Batch, jax.Array], tuple[Carry, jax.Array]]


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.maximum(mask.sum(), 1)


def run_local_steps(step_fn: StepFn, carry: Carry, data: ClientData, key: jax.Array, *,
                    epochs: int, batch_size: int) -> tuple[Carry, dict]:
    """Runs `epochs` exact epochs of `step_fn` over one client's data.

    `step_fn(carry, batch, key) -> (carry, mean_batch_loss)`. Returns the final
    carry and {'loss': mean loss over all examples seen, 'num_steps': real steps}.

    The loop is a `lax.while_loop` over the client's own number of steps. Under
    `vmap` it runs as long as the busiest *sampled* client and keeps finished
    clients' carries unchanged, so the padded steps of a round are set by the
    clients in it, not by the largest client of the whole federation.
    """
    per_epoch = steps_per_epoch(data.count, batch_size)
    num_steps = epochs * per_epoch
    order_key, step_key = jax.random.split(key)
    orders = epoch_permutations(order_key, data.count, data.max_count, epochs)

    def body(state):
        t, carry, loss_sum, seen = state
        batch_key, fn_key = jax.random.split(jax.random.fold_in(step_key, t))
        epoch = jnp.minimum(t // per_epoch, epochs - 1)
        batch = client_batch(data, orders[epoch], t % per_epoch, batch_size, batch_key, train=True)
        carry, loss = step_fn(carry, batch, fn_key)
        n = batch.mask.sum()
        return t + 1, carry, loss_sum + loss * n, seen + n

    init = (jnp.zeros((), jnp.int32), carry, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    _, carry, loss_sum, seen = jax.lax.while_loop(lambda state: state[0] < num_steps, body, init)
    return carry, {"loss": loss_sum / jnp.maximum(seen, 1), "num_steps": num_steps}


@dataclasses.dataclass(frozen=True)
class LocalObjective:
    """How a method's local step differs from plain (momentum) SGD on the cross-entropy.

    Every field is optional; `LocalSGD.train` runs one step for all methods (a `batch` is a
    `data.federated.Batch`: `x`, `y` and `mask`, False on the padding of a short batch):
      forward(trainable, key) -> {'params', 'unit_masks'?}: what the forward pass uses, from the
        trainable leaves and the step's own key (SpaFL: straight-through threshold masks;
        sub-models: fixed masks; FedPM: a Bernoulli mask sampled every step; Fjord: a width
        drawn every batch);
      extra_loss(trainable) -> scalar added to the task loss (FedProx's proximal term,
        SpaFL's threshold regularizer);
      feature_loss(trainable, batch, features) -> scalar added to the task loss, given the step's
        batch and the model's representation of it ([B, d]: what its classifier reads, `Model.apply`
        with `features=True`; padded examples are in the batch with `batch.mask` False): MOON's
        contrastive term, which runs the global and the previous model on the same batch itself;
      label_mask: [num_classes] bool (HeteroFL's label split): the logits of other classes
        become `label_mask_fill` before the softmax: -inf (default) leaves them out of it,
        0 (HeteroFL's and FedRolex's `masked_fill`) keeps them in it at logit 0;
      grad_correction(grads) -> grads (SCAFFOLD's and SPATL's control variates);
      update_mask: bools shaped like {'params', 'batch_stats'}: entries allowed to change
        (a sub-model's weights; every other entry, momentum and weight decay included,
        stays exactly as it was, and so do the BatchNorm statistics of dropped units);
      after_step(before, after, batch) -> (trainable, metrics): a projection after each
        step (SpaFL's clipping and reset) and per-step figures, summed over the real steps;
      optimizer(learning_rate) -> optax transformation replacing the run's (momentum) SGD
        (FedPM trains its scores with Adam at the run's learning rate);
      step_loss(trainable, batch_stats, batch, key) -> (loss, new batch_stats): the step's task loss
        in place of the one forward pass (`forward`) and its label-masked cross-entropy (neither is
        then read), for a method that runs the model more than once a step (Fjord's distillation:
        a teacher and a student pass) or holds its BatchNorm statistics in a layout of its own
        (Fjord's per-width sets: `batch_stats` is whatever `train` was given, and `update_mask`'s
        'batch_stats' is shaped like it); the loss it returns is the one reported.
    """

    forward: Callable[[dict, jax.Array], dict] | None = None
    extra_loss: Callable[[dict], jax.Array] | None = None
    feature_loss: Callable[[dict, Batch, jax.Array], jax.Array] | None = None
    label_mask: jax.Array | None = None
    label_mask_fill: float = -math.inf
    grad_correction: Callable[[dict], dict] | None = None
    update_mask: dict | None = None
    after_step: Callable[[dict, dict, Batch], tuple[dict, dict]] | None = None
    optimizer: Callable[[jax.Array], optax.GradientTransformation] | None = None
    step_loss: Callable[[dict, Any, Batch, jax.Array], tuple[jax.Array, Any]] | None = None


def proximal_term(params: Any, anchor: Any, mu: float) -> jax.Array:
    """(mu / 2) ||params - anchor||^2 over every leaf: FedProx's term, and the pull toward a point of
    any method that adds one to its local loss (`LocalObjective.extra_loss`).

        >>> float(proximal_term({"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([0.0, 0.0])}, 0.5))
        1.25
    """
    squares = jax.tree_util.tree_map(lambda w, a: jnp.sum((w - a) ** 2), params, anchor)
    return 0.5 * mu * sum(jax.tree_util.tree_leaves(squares))


def label_masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                               label_mask: jax.Array | None, fill: float = -math.inf) -> jax.Array:
    """Cross-entropy with the logits of classes outside `label_mask` set to `fill` (-inf: over the
    classes of `label_mask` only; None: all classes as they are)."""
    if label_mask is not None:
        logits = jnp.where(label_mask, logits, fill)
    return masked_cross_entropy(logits, labels, mask)


TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by (total norm + 1e-6)


def clip_grad_norm(max_norm: float) -> optax.GradientTransformation:
    """Every gradient times min(1, max_norm / (global L2 norm + 1e-6)): PyTorch's `clip_grad_norm_`,
    which the authors' code of SpaFL (3), HeteroFL and FedRolex (1) and FedP3 (10) apply before their
    optimizer step (optax's `clip_by_global_norm` omits the 1e-6, so it differs in the last bits).

        >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}  # global norm 5
        >>> clipped, _ = clip_grad_norm(2.5).update(grads, optax.EmptyState())
        >>> [round(float(x), 5) for x in clipped["a"]]
        [1.5, 2.0]
    """

    def update(grads, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / (optax.tree.norm(grads) + TORCH_CLIP_EPS))
        return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Local training of a model with (momentum) SGD, the optimizer of all four papers.

    The optimizer state starts fresh every round, as in the papers' code. `grad_clip_norm`
    clips each step's gradients to that global L2 norm first, as PyTorch's `clip_grad_norm_`
    (`clip_grad_norm`) does in the authors' code of HeteroFL, FedRolex, FedP3 and SpaFL. The
    learning rate of round r is `learning_rate * lr_decay ** r` (SpaFL's CIFAR-100
    schedule decays it by 0.993 per round); a function of the round index, so a
    resumed run uses exactly the rate the uninterrupted run would have.
    """

    model: Model
    learning_rate: float
    epochs: int
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 1.0
    grad_clip_norm: float | None = None

    def __post_init__(self):
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"--lr must be a finite number > 0, got {self.learning_rate}")
        if self.epochs < 1:
            raise ValueError(f"--local-epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0.0 < self.lr_decay <= 1.0:
            raise ValueError(f"--lr-decay must be in (0, 1], got {self.lr_decay}")
        if self.grad_clip_norm is not None and not (self.grad_clip_norm > 0 and math.isfinite(self.grad_clip_norm)):
            raise ValueError(f"--grad-clip-norm must be a finite number > 0 (or none), got {self.grad_clip_norm}")

    def learning_rate_at(self, round_index: jax.Array | int) -> jax.Array:
        if self.lr_decay == 1.0:
            return jnp.asarray(self.learning_rate, jnp.float32)
        return self.learning_rate * jnp.asarray(self.lr_decay, jnp.float32) ** jnp.asarray(round_index, jnp.float32)

    def optimizer(self, learning_rate: jax.Array | float | None = None) -> optax.GradientTransformation:
        lr = self.learning_rate if learning_rate is None else learning_rate
        sgd = optax.chain(optax.add_decayed_weights(self.weight_decay), optax.sgd(lr, momentum=self.momentum or None))
        if self.grad_clip_norm is None:
            return sgd
        return optax.chain(clip_grad_norm(self.grad_clip_norm), sgd)  # torch clips the raw gradients, then steps

    def effective_steps(self, num_steps: jax.Array) -> jax.Array:
        """||a||_1 of FedNova: the sum of the weights momentum gives to the gradients of `num_steps` steps.

        With momentum rho, step t's gradient moves the weights by lr (1 - rho^(tau - t)) / (1 - rho)
        in total by the end of tau steps; summed, [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)
        (= tau without momentum). Dividing a displacement by this times lr gives the mean gradient,
        which is what SCAFFOLD's and SPATL's control variates estimate.
        """
        tau = jnp.asarray(num_steps).astype(jnp.float32)
        rho = self.momentum
        if rho == 0.0:
            return tau
        return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)

    def train(self, variables: dict, data: ClientData, key: jax.Array, *, round_index: jax.Array | int = 0,
              extra: dict | None = None, objective: LocalObjective | None = None) -> tuple[dict, dict]:
        """Trains `variables` ({'params', 'batch_stats'}) and the `extra` trainable leaves on one client.

        Returns (variables with the extra leaves added under their names, stats): stats are
        {'loss': mean task loss over all examples seen, 'num_steps': real steps} plus the sums
        of `objective.after_step`'s metrics. The optimizer starts fresh.
        """
        variables, _, stats = self.train_with_optimizer_state(variables, data, key, round_index=round_index,
                                                              extra=extra, objective=objective)
        return variables, stats

    def train_with_optimizer_state(self, variables: dict, data: ClientData, key: jax.Array, *,
                                   round_index: jax.Array | int = 0, extra: dict | None = None,
                                   objective: LocalObjective | None = None,
                                   optimizer_state: Any = None) -> tuple[dict, Any, dict]:
        """`train`, continuing from `optimizer_state` (None: a fresh one) and returning the
        optimizer's final state too: (variables, optimizer_state, stats). For a method whose
        clients keep their optimizer between rounds (FedPM's per-client Adam)."""
        objective = objective or LocalObjective()
        if objective.feature_loss is not None and objective.step_loss is not None:
            raise ValueError("a local objective's feature_loss reads the one forward pass, which its step_loss "
                             "replaces; compute the features in step_loss instead")
        learning_rate = self.learning_rate_at(round_index)
        tx = objective.optimizer(learning_rate) if objective.optimizer is not None else self.optimizer(learning_rate)
        model = self.model
        extra = extra or {}
        if "params" in extra or "batch_stats" in extra:
            raise ValueError("extra trainable leaves may not be named 'params' or 'batch_stats'")
        mask = objective.update_mask

        def forward(trainable, key):
            if objective.forward is not None:
                return objective.forward(trainable, key)
            return {"params": trainable["params"]}

        def after_step(before, after, batch):
            if objective.after_step is None:
                return after, {}
            return objective.after_step(before, after, batch)

        def step(carry, batch: Batch, key):
            trainable, batch_stats, opt_state, sums = carry

            def loss_fn(trainable):
                if objective.step_loss is not None:
                    task, new_stats = objective.step_loss(trainable, batch_stats, batch, key)
                else:
                    logits, new_stats, *features = model.apply(
                        {**forward(trainable, key), "batch_stats": batch_stats}, batch.x, train=True, mask=batch.mask,
                        features=objective.feature_loss is not None)
                    task = label_masked_cross_entropy(logits, batch.y, batch.mask, objective.label_mask,
                                                      objective.label_mask_fill)
                total = task + objective.extra_loss(trainable) if objective.extra_loss is not None else task
                if objective.feature_loss is not None:
                    total = total + objective.feature_loss(trainable, batch, features[0])
                return total, (task, new_stats)

            grads, (task, new_stats) = jax.grad(loss_fn, has_aux=True)(trainable)
            if objective.grad_correction is not None:
                grads = objective.grad_correction(grads)
            updates, opt_state = tx.update(grads, opt_state, trainable)
            if mask is not None:
                updates = {**updates, "params": jax.tree_util.tree_map(
                    lambda u, m: jnp.where(m, u, jnp.zeros_like(u)), updates["params"], mask["params"])}
                new_stats = jax.tree_util.tree_map(jnp.where, mask["batch_stats"], new_stats, batch_stats)
            new, metrics = after_step(trainable, optax.apply_updates(trainable, updates), batch)
            sums = jax.tree_util.tree_map(lambda s, m: s + m, sums, metrics)
            return (new, new_stats, opt_state, sums), task

        trainable = {"params": variables["params"], **extra}
        batch_shape = jax.eval_shape(lambda: client_batch(data, jnp.arange(data.max_count), 0, self.batch_size,
                                                          key, train=False))
        metric_shapes = jax.eval_shape(lambda t, b: after_step(t, t, b)[1], trainable, batch_shape)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
        opt_state = tx.init(trainable) if optimizer_state is None else optimizer_state
        carry = (trainable, variables["batch_stats"], opt_state, zeros)
        (trainable, batch_stats, opt_state, sums), stats = run_local_steps(step, carry, data, key, epochs=self.epochs,
                                                                           batch_size=self.batch_size)
        return {**trainable, "batch_stats": batch_stats}, opt_state, {**stats, **sums}
