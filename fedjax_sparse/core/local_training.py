"""Local training as one loop over a client's steps, with exact epochs.

A client with n examples takes ceil(n / B) steps per epoch. Clients of
different sizes vmap together: the vmapped loop runs the busiest sampled
client's number of steps and a padded step leaves a client's carry unchanged.
"""

from __future__ import annotations

import dataclasses
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
class LocalSGD:
    """Local training of a model with (momentum) SGD, the optimizer of all four papers.

    The optimizer state starts fresh every round, as in the papers' code.
    `train` takes hooks so that algorithms change only their own math:
      extra_loss(params) is added to the task loss (FedProx's proximal term);
      grad_correction(grads) edits the gradient (SCAFFOLD's c - c_i);
      post_update(params) projects after each step (SpaFL's clipping).
    """

    model: Model
    learning_rate: float
    epochs: int
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"learning rate must be > 0, got {self.learning_rate}")
        if self.epochs < 1:
            raise ValueError(f"local epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")

    def optimizer(self) -> optax.GradientTransformation:
        return optax.chain(optax.add_decayed_weights(self.weight_decay),
                           optax.sgd(self.learning_rate, momentum=self.momentum or None))

    def train(self, variables: dict, data: ClientData, key: jax.Array, *,
              extra_loss: Callable | None = None, grad_correction: Callable | None = None,
              post_update: Callable | None = None) -> tuple[dict, dict]:
        tx = self.optimizer()
        model = self.model

        def step(carry, batch: Batch, key):
            del key
            variables, opt_state = carry

            def loss_fn(params):
                logits, batch_stats = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                                  batch.x, train=True, mask=batch.mask)
                task = masked_cross_entropy(logits, batch.y, batch.mask)
                total = task + extra_loss(params) if extra_loss is not None else task
                return total, (task, batch_stats)

            grads, (task, batch_stats) = jax.grad(loss_fn, has_aux=True)(variables["params"])
            if grad_correction is not None:
                grads = grad_correction(grads)
            updates, opt_state = tx.update(grads, opt_state, variables["params"])
            params = optax.apply_updates(variables["params"], updates)
            if post_update is not None:
                params = post_update(params)
            return ({"params": params, "batch_stats": batch_stats}, opt_state), task

        carry = (variables, tx.init(variables["params"]))
        (variables, _), stats = run_local_steps(step, carry, data, key, epochs=self.epochs,
                                                batch_size=self.batch_size)
        return variables, stats
