"""Server optimizers (FedOpt; Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

Every method whose server step is "global += lr x mean model delta" (FedAvg, FedProx,
SCAFFOLD, FedNova, FedLDF and its baselines, the sub-model family, SPATL's encoder) takes
that step here: the round's mean delta Delta is negated into a pseudo-gradient and handed to
an optax transformation, whose state is part of the server state (so checkpoints and exact
resume cover it). `ServerOptimizer.apply` is the one place that turns the old global weights
and the aggregate into the new weights and the new optimizer state.

  sgd       x <- x + eta Delta. At eta = 1 each method's own rule (FedAvg's mean replaces
            x); SCAFFOLD's eta_g and SPATL's eq. 12 step are this eta.
  momentum  u <- mu u + Delta, x <- x + eta u (FedAvgM, Hsu et al. 2019).
  adagrad, adam, yogi: Algorithm 2 of the paper, as written (no bias correction):
            m <- b1 m + (1 - b1) Delta
            v <- v + Delta^2                                  (adagrad)
                 b2 v + (1 - b2) Delta^2                      (adam)
                 v - (1 - b2) Delta^2 sign(v - Delta^2)       (yogi)
            x <- x + eta m / (sqrt(v) + tau)
            from m = 0 and v = tau^2 (Algorithm 2 asks v_{-1} >= tau^2).
Defaults: b1 = 0.9 and b2 = 0.99, the values the paper's experiments fix for the adaptive
methods (section 5, "Optimizers and hyperparameters"), tau = 1e-3 (the adaptivity its
experiments and the authors' code recommend across tasks), and server momentum 0.9 (its
FedAvgM baseline). As in Algorithm 2, FedAdagrad keeps the b1 momentum; b1 = 0 gives plain
Adagrad (what the authors' code ran, through Keras' Adagrad).

Only trainable weights are optimized: BatchNorm running statistics are not gradients and
take the aggregate as before. Entries no client held in a round (a sub-model leaves units
out, SPATL's uploads leave channels out) get no pseudo-gradient at all rather than a zero one:
their value and their optimizer state stay exactly as they were (a sparse, "lazy" update, as
sparse embedding optimizers do), so momentum from earlier rounds does not move an entry nobody
trained, and its moments do not decay for lack of news. With sgd this is the methods' own rule
(masked_mean keeps such entries).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from fedjax_sparse.core.contract.options import option

tree_map = jax.tree_util.tree_map

SERVER_OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam", "yogi")
STATE_KEY = "server_optimizer"


@dataclasses.dataclass(frozen=True)
class ServerOptimizerOptions:
    """The server optimizer's flags; every algorithm with a "global += lr x mean delta" step
    declares them by deriving its options from this class (one flag, one declaration)."""

    OPTION_GROUP = "server-optimizer"  # the command line's help group (`core.contract.options.option_group`)

    server_optimizer: str = option("sgd", "the server's optimizer on the pseudo-gradient (FedOpt): sgd (at "
                                          "--server-lr 1 each method's own step), momentum (FedAvgM), "
                                          "adagrad, adam or yogi", choices=SERVER_OPTIMIZERS)
    server_lr: float = option(1.0, "server learning rate eta (SCAFFOLD's eta_g, SPATL's eq. 12 step)",
                              low=0.0, low_open=True)
    server_momentum: float = option(0.9, "momentum of --server-optimizer momentum", low=0.0, high=1.0,
                                    high_open=True)
    server_beta1: float = option(0.9, "adagrad, adam, yogi: decay of the first moment (beta_1)", low=0.0,
                                 high=1.0, high_open=True)
    server_beta2: float = option(0.99, "adam, yogi: decay of the second moment (beta_2)", low=0.0, high=1.0,
                                 high_open=True)
    server_epsilon: float = option(1e-3, "adagrad, adam, yogi: tau, the adaptivity (smaller: more adaptive)",
                                   low=0.0, low_open=True)

    def ignored(self) -> dict[str, str]:
        """The server optimizer's flags that the chosen one does not read (`core.contract.options.refuse_ignored`);
        a subclass with its own adds them to these."""
        readers = {"server_momentum": ("momentum",), "server_beta1": ("adagrad", "adam", "yogi"),
                   "server_beta2": ("adam", "yogi"), "server_epsilon": ("adagrad", "adam", "yogi")}
        return {name: f"is read only by --server-optimizer {' or '.join(users)}; --server-optimizer "
                      f"{self.server_optimizer} does not read it"
                for name, users in readers.items() if self.server_optimizer not in users}


class FedOptState(NamedTuple):
    m: Any
    v: Any


def scale_by_fedopt(second_moment: str, b1: float, b2: float, tau: float) -> optax.GradientTransformation:
    """Algorithm 2's direction m / (sqrt(v) + tau), as an optax transformation of gradients g.

    Fed the pseudo-gradient g = -Delta, m is the negated m of Algorithm 2 and v is the same
    (it sees only squares), so a following `scale_by_learning_rate` gives x + eta m / (sqrt(v) + tau).
    """

    def init(params):
        return FedOptState(m=tree_map(jnp.zeros_like, params), v=tree_map(lambda p: jnp.full_like(p, tau ** 2), params))

    def second(v, g):
        g2 = jnp.square(g)
        if second_moment == "adagrad":
            return v + g2
        if second_moment == "adam":
            return b2 * v + (1.0 - b2) * g2
        return v - (1.0 - b2) * g2 * jnp.sign(v - g2)  # yogi

    def update(grads, state, params=None):
        del params
        m = tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state.m, grads)
        v = tree_map(second, state.v, grads)
        return tree_map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v), FedOptState(m, v)

    return optax.GradientTransformation(init, update)


def _keep_unheld(new_state: Any, old_state: Any, held: Any) -> Any:
    """The optimizer state with every params-shaped part kept at its old value where nothing was held."""
    structure = jax.tree_util.tree_structure(held)

    def params_shaped(x):
        return jax.tree_util.tree_structure(x) == structure

    def merge(new, old):
        return tree_map(jnp.where, held, new, old) if params_shaped(new) else new

    return tree_map(merge, new_state, old_state, is_leaf=params_shaped)


@dataclasses.dataclass(frozen=True)
class ServerOptimizer:
    """An optax transformation applied to the server's pseudo-gradient (see the module docstring)."""

    transformation: optax.GradientTransformation
    name: str = "sgd"

    def init(self, params: Any) -> Any:
        return self.transformation.init(params)

    def apply(self, params: Any, mean_delta: Any, state: Any, held: Any = None) -> tuple[Any, Any]:
        """(new params, new optimizer state) from the round's mean model delta.

        held: booleans shaped like `params` (None: every entry): where False, nobody held the
        entry this round and its value and optimizer state are kept.
        """
        chex.assert_trees_all_equal_shapes(params, mean_delta)
        pseudo_gradient = tree_map(lambda d: -d.astype(jnp.float32), mean_delta)
        updates, new_state = self.transformation.update(pseudo_gradient, state, params)
        new_params = tree_map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        if held is None:
            return new_params, new_state
        chex.assert_trees_all_equal_shapes(params, held)
        return tree_map(jnp.where, held, new_params, params), _keep_unheld(new_state, state, held)

    def init_state(self, variables: dict, key: str = "variables") -> dict:
        """A server state holding the global `variables` under `key` and the optimizer's state of their params."""
        return {key: variables, STATE_KEY: self.init(variables["params"])}

    def step_toward(self, server_state: dict, aggregate: dict, held: dict | None = None,
                    key: str = "variables") -> dict:
        """The server state after a step of its variables (under `key`) toward the clients' `aggregate`:
        Delta = aggregate - global for the params; every other collection (BatchNorm statistics) is the
        aggregate's. `aggregate` may hold a subset of the collections; the others stay."""
        variables = server_state[key]
        delta = tree_map(jnp.subtract, aggregate["params"], variables["params"])
        params, state = self.apply(variables["params"], delta, server_state[STATE_KEY],
                                   None if held is None else held["params"])
        return {**server_state, key: {**variables, **aggregate, "params": params}, STATE_KEY: state}


def without_optimizer_state(server_state: dict) -> dict:
    """The server state less the optimizer's state, which never leaves the server (what a broadcast sends).

    Server momentum over two rounds toward the same aggregate, and what a broadcast would send:

        >>> import jax.numpy as jnp
        >>> server = server_optimizer("momentum", lr=1.0, momentum=0.5)
        >>> state = server.init_state({"params": {"w": jnp.zeros(2)}})
        >>> state = server.step_toward(state, {"params": {"w": jnp.ones(2)}})  # u = 1, w = 0 + 1
        >>> state = server.step_toward(state, {"params": {"w": jnp.ones(2)}})  # u = 0.5 + 0 = 0.5, w = 1.5
        >>> state["variables"]["params"]["w"].tolist(), sorted(without_optimizer_state(state))
        ([1.5, 1.5], ['variables'])
    """
    return {k: v for k, v in server_state.items() if k != STATE_KEY}


def server_optimizer(name: str = "sgd", lr: float = 1.0, momentum: float = 0.9, beta1: float = 0.9,
                     beta2: float = 0.99, epsilon: float = 1e-3) -> ServerOptimizer:
    """A server optimizer by name (the defaults are those of `ServerOptimizerOptions`)."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(f"--server-optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {name!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"--server-lr must be a finite number > 0, got {lr}")
    if name == "sgd":
        return ServerOptimizer(optax.sgd(lr), name)
    if name == "momentum":
        return ServerOptimizer(optax.sgd(lr, momentum=momentum), name)
    return ServerOptimizer(optax.chain(scale_by_fedopt(name, beta1, beta2, epsilon),
                                       optax.scale_by_learning_rate(lr)), name)


def from_options(options: ServerOptimizerOptions) -> ServerOptimizer:
    return server_optimizer(options.server_optimizer, options.server_lr, options.server_momentum,
                            options.server_beta1, options.server_beta2, options.server_epsilon)
