"""SPATL's selection agent: the graph of a real encoder, equivariance of the networks, GAE by
hand, PPO on a bandit with a computable optimum, the FLOPs budget, synthetic layer importance,
vmap over clients against a loop, and continual learning across searches."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.agent import (ActorCritic, AgentConfig, GraphTemplate, Observation, PruningEnv,
                                 generalized_advantages, graph_state, init_agent,
                                 largest_uniform_keep_ratio, policy_fn, search, search_clients,
                                 unit_norm_statistics)
from fedjax_sparse.core.structure.unit_selection import kept_units
from fedjax_sparse.models import get_model

tree_map = jax.tree_util.tree_map
STATIC = ("env", "template", "config")
search_jit = jax.jit(search, static_argnames=STATIC)  # compiled cheaply: see conftest.py
search_clients_jit = jax.jit(search_clients, static_argnames=STATIC)


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol), a, b)


def stack(trees):
    return tree_map(lambda *xs: jnp.stack(xs), *trees)


RESNET20 = GraphTemplate.from_structure(get_model("resnet20", (32, 32, 3), 10).structure)


# ------------------------------------------------------------------ a synthetic client of ResNet-20
# Layer l's accuracy factor is 1 - importance_l (1 - kept_l)^2: pruning an important layer
# (importance 1) costs a lot, an unimportant one (0.02) almost nothing. FLOPs are the real
# layer shares times the kept fraction of units (counted as `core.structure.unit_selection.kept_units` counts).

def resnet_flops_kept(env_state, keep_ratios):
    del env_state
    units = jnp.asarray(RESNET20.num_units)
    return jnp.sum(jnp.asarray(RESNET20.flops_share) * jax.vmap(kept_units)(units, keep_ratios) / units)


def resnet_norm_stats(env_state, keep_ratios):
    return jnp.stack([env_state["importance"], jnp.zeros_like(keep_ratios), keep_ratios], axis=1)


def resnet_accuracy(env_state, keep_ratios):
    return 0.9 * jnp.prod(1.0 - env_state["importance"] * (1.0 - keep_ratios) ** 2)


RESNET_ENV = PruningEnv(resnet_flops_kept, resnet_norm_stats, resnet_accuracy)
RESNET_CONFIG = AgentConfig(updates=10, hidden_size=16, message_passing_steps=1)


def resnet_client(important_every=3):
    return {"importance": jnp.where(jnp.arange(RESNET20.num_nodes) % important_every == 0, 1.0, 0.02)}


def run_clients(config, env_states, seeds):
    agents = stack([init_agent(jax.random.key(s), RESNET20, RESNET_CONFIG) for s in seeds])
    keys = jnp.stack([jax.random.key(1000 + s) for s in seeds])
    return search_clients_jit(agents, stack(env_states), keys, env=RESNET_ENV, template=RESNET20,
                              config=config)


@pytest.fixture(scope="module")
def three_seeds():
    """3 agents (seeds 0, 1, 2) searching the same client, as `search_clients` runs them."""
    return run_clients(RESNET_CONFIG, [resnet_client()] * 3, [0, 1, 2])


# ------------------------------------------------------------------ the graph

def test_resnet20_graph_has_a_node_per_encoder_layer_and_an_edge_per_dependency():
    structure = get_model("resnet20", (32, 32, 3), 10).structure
    assert RESNET20.layer_names == tuple(l.name for l in structure.part("encoder"))
    assert RESNET20.num_nodes == 18
    edges = {(RESNET20.layer_names[s], RESNET20.layer_names[r]) for s, r in zip(RESNET20.senders, RESNET20.receivers)}
    # Each stage: 3 conv1 -> conv2 edges, and block b's conv1 reads the b - 1 earlier conv2s
    # (0 + 1 + 2); each downsampling conv1 reads the previous stage's 3 conv2s. The private
    # stem feeds stage 1 but is not a node.
    assert RESNET20.num_edges == len(edges) == 3 * (3 + 0 + 1 + 2) + 2 * 3
    assert ("stage1_block1.conv2", "stage1_block3.conv1") in edges   # residual sum
    assert ("stage1_block2.conv2", "stage1_block3.conv1") in edges
    assert ("stage2_block3.conv2", "stage3_block1.conv1") in edges
    assert ("stage1_block1.conv1", "stage1_block1.conv2") in edges
    assert not any("conv1" == s for s, _ in edges)
    residual = dict(zip(zip(RESNET20.senders, RESNET20.receivers), RESNET20.edge_is_residual))
    index = {n: i for i, n in enumerate(RESNET20.layer_names)}
    assert residual[index["stage1_block2.conv2"], index["stage1_block3.conv1"]]
    assert not residual[index["stage1_block1.conv1"], index["stage1_block1.conv2"]]
    assert sum(RESNET20.flops_share) == pytest.approx(1.0)
    static = np.asarray(RESNET20.static_features)
    assert static[:, 6].sum() == pytest.approx(1.0)                       # weights shares
    np.testing.assert_array_equal(static[:, 0], 1.0)                      # all conv
    flops = [l.fan_in * l.num_units * l.output_hw for l in structure.part("encoder")]
    assert RESNET20.flops_share[1] == pytest.approx(16 * 144 * 1024 / sum(flops))

    graph = graph_state(RESNET20, jnp.full(18, 0.5), jnp.zeros((18, 3)), jnp.asarray(0.7), 0.8)
    assert graph.nodes.shape == (18, RESNET20.num_node_features)
    np.testing.assert_array_equal(graph.nodes[:, 7], 0.5)
    np.testing.assert_allclose(graph.globals, [[0.7, 0.8]])
    assert graph.n_node.tolist() == [18] and graph.n_edge.tolist() == [RESNET20.num_edges]


def test_graph_template_rejects_unknown_layers():
    structure = get_model("resnet20", (32, 32, 3), 10).structure
    with pytest.raises(ValueError, match="not in the structure"):
        GraphTemplate.from_structure(structure, ("stage1_block1.conv1", "nope"))


def test_unit_norm_statistics_by_hand():
    """Norms a = (3, 1), b = (2, 2, 2, 2): encoder mean 12 / 6 = 2. a relative (1.5, .5): mean 1,
    std .5; keeping round(.5 x 2) = 1 unit holds 3 / 4. b relative all 1: mean 1, std 0; keeping
    round(.25 x 4) = 1 unit holds 2 / 8. A ratio that rounds to 0 units still keeps 1."""
    norms = {"a": jnp.array([1.0, 3.0]), "b": jnp.full(4, 2.0)}
    statistics = jax.jit(unit_norm_statistics, static_argnums=1)  # as a client computes them: one program
    stats = statistics(norms, ("a", "b"), jnp.array([0.5, 0.25]))
    np.testing.assert_allclose(stats, [[1.0, 0.5, 0.75], [1.0, 0.0, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(statistics(norms, ("a", "b"), jnp.array([0.0, 1.0]))[:, 2], [0.75, 1.0])


# ------------------------------------------------------------------ the networks

def test_actor_means_permute_with_the_nodes_and_the_value_does_not_change():
    """One message-passing block (RESNET_CONFIG's): deeper encoders stack the same block, and a
    composition of equivariant maps is equivariant."""
    rng = np.random.default_rng(0)
    graph = graph_state(RESNET20, jnp.asarray(rng.uniform(0.1, 1, 18), jnp.float32),
                        jnp.asarray(rng.normal(size=(18, 3)), jnp.float32), jnp.asarray(0.6), 0.8)
    network = ActorCritic(RESNET_CONFIG.hidden_size, RESNET_CONFIG.message_passing_steps)
    params = {"params": init_agent(jax.random.key(0), RESNET20, RESNET_CONFIG).params}
    apply = jax.jit(network.apply)
    means, value = apply(params, graph)

    perm = rng.permutation(18)                  # new node j is old node perm[j]
    new_index = np.argsort(perm)
    edge_order = rng.permutation(RESNET20.num_edges)
    relabeled = graph._replace(nodes=graph.nodes[perm], edges=graph.edges[edge_order],
                               senders=jnp.asarray(new_index[np.asarray(graph.senders)[edge_order]]),
                               receivers=jnp.asarray(new_index[np.asarray(graph.receivers)[edge_order]]))
    new_means, new_value = apply(params, relabeled)
    np.testing.assert_allclose(new_means, means[perm], atol=1e-5)
    np.testing.assert_allclose(new_value, value, atol=1e-5)
    assert np.all((means > 0) & (means < 1))
    assert np.ptp(np.asarray(means)) > 1e-3     # the nodes are told apart


# ------------------------------------------------------------------ PPO

def test_generalized_advantages_by_hand():
    """gamma .9; episode 1 = steps 0-1 (reward 1 at its end), episode 2 = steps 2-3, cut off and
    bootstrapped with V = 1. lambda = 1: returns (.9, 1, 2.61, 2.9), advantages = returns - .5.
    lambda = 0: advantages are the one-step TD errors r + .9 V' (1 - done) - V."""
    rewards, dones = jnp.array([0.0, 1.0, 0.0, 2.0]), jnp.array([False, True, False, False])
    values, last = jnp.full(4, 0.5), jnp.asarray(1.0)
    advantages, returns = generalized_advantages(rewards, values, dones, last, 0.9, 1.0)
    np.testing.assert_allclose(returns, [0.9, 1.0, 2.61, 2.9], rtol=1e-6)
    np.testing.assert_allclose(advantages, np.array([0.9, 1.0, 2.61, 2.9]) - 0.5, rtol=1e-6)
    td, _ = generalized_advantages(rewards, values, dones, last, 0.9, 0.0)
    np.testing.assert_allclose(td, [-0.05, 0.5, -0.05, 2.4], rtol=1e-6)


# The bandit: every episode is one step, FLOPs are always within budget, and layer l should keep
# BANDIT_KEEP[l % 3], which its first norm statistic tells it (a contextual bandit).
BANDIT_KEEP = np.array([0.8, 0.5, 0.3])
BANDIT_TARGETS = jnp.asarray(BANDIT_KEEP[np.arange(18) % 3], jnp.float32)


def no_flops(env_state, keep_ratios):
    del env_state, keep_ratios
    return jnp.zeros(())


def target_as_norm_stats(env_state, keep_ratios):
    return jnp.stack([env_state, jnp.zeros_like(keep_ratios), jnp.zeros_like(keep_ratios)], axis=1)


def bandit_accuracy(env_state, keep_ratios):
    return 1.0 - jnp.mean((keep_ratios - env_state) ** 2)


BANDIT_ENV = PruningEnv(no_flops, target_as_norm_stats, bandit_accuracy)
BANDIT_CONFIG = dataclasses.replace(RESNET_CONFIG, updates=40, max_episode_steps=1, action_std=0.1,
                                    learning_rate=1e-3)


def bandit_expected_reward(means, std, p_min):
    """100 x E[accuracy] of the policy with these means, per layer, by Monte Carlo over a fixed sample."""
    eps = np.random.default_rng(0).standard_normal(100_000)
    means = np.asarray(means)
    keep = np.clip(1 - np.clip(means[..., None] + std * eps, 0, 1), p_min, 1)
    return 100 * (1 - ((keep - BANDIT_KEEP.reshape((3,) + (1,) * means.ndim)) ** 2).mean(-1))


@pytest.fixture(scope="module")
def bandit_search():
    """(initial agent, key, its state and result after a search of BANDIT_CONFIG)."""
    initial, key = init_agent(jax.random.key(0), RESNET20, RESNET_CONFIG), jax.random.key(1)
    agent, result = search_jit(initial, BANDIT_TARGETS, key, env=BANDIT_ENV, template=RESNET20,
                               config=BANDIT_CONFIG)
    return initial, key, agent, result


def test_ppo_finds_the_best_actions_of_a_one_step_bandit(bandit_search):
    """Reward 100 (1 - mean squared distance of the keep ratios to their targets). The optimal
    means, with the action clipped to [0, 1] and the ratio to [p_min, 1], come from a grid search
    over the expected reward."""
    config = BANDIT_CONFIG
    _, _, agent, result = bandit_search
    start = Observation(jnp.ones(18), target_as_norm_stats(BANDIT_TARGETS, jnp.ones(18)), jnp.zeros(()))
    node_means = jax.jit(policy_fn(RESNET20, config))(agent.params, start)[0].reshape(6, 3)
    means = node_means.mean(0)

    grid = np.linspace(0, 1, 101)
    per_layer = bandit_expected_reward(np.broadcast_to(grid, (3, 101)), config.action_std, config.min_keep_ratio)
    optimal_means = grid[per_layer.argmax(1)]
    np.testing.assert_allclose(optimal_means, 1 - BANDIT_KEEP, atol=0.03)
    np.testing.assert_allclose(means, optimal_means, atol=0.06)
    np.testing.assert_allclose(node_means, np.broadcast_to(optimal_means, (6, 3)), atol=0.1)
    learned = bandit_expected_reward(means, config.action_std, config.min_keep_ratio).mean()
    assert learned > per_layer.max(1).mean() - 0.5
    rewards = np.asarray(result.mean_episode_reward)
    assert rewards[-10:].mean() > rewards[0] + 3.0
    assert bool(result.agent_met_target) and result.reward > 99.0


# ------------------------------------------------------------------ the search

def test_agent_beats_uniform_pruning_when_layers_differ_in_importance(three_seeds):
    _, result = three_seeds
    uniform = largest_uniform_keep_ratio(RESNET_ENV, resnet_client(), 18, RESNET_CONFIG.flops_budget)
    uniform_reward = 100 * resnet_accuracy(resnet_client(), jnp.full(18, uniform))
    assert np.all(np.asarray(result.met_target)) and np.all(np.asarray(result.agent_met_target))
    assert float(jnp.mean(result.reward)) > float(uniform_reward) + 5.0
    # The best ratios spare the important layers (every third) more than the rest.
    important = np.arange(18) % 3 == 0
    ratios = np.asarray(result.keep_ratios)
    assert np.all(ratios[:, important].mean(1) > ratios[:, ~important].mean(1))
    # And the policy itself improves: later episodes end with higher rewards than the first ones.
    rewards = np.asarray(result.mean_episode_reward)
    assert rewards[:, -3:].mean() > rewards[:, :3].mean() + 5.0


def test_the_agent_lands_on_the_flops_target_within_one_unit(three_seeds):
    """The step that crosses the budget is cut back (bisection of its size): the ratios the agent
    returns cut the FLOPs by the 0.2 target plus at most one unit's share (the largest of any layer),
    not by whatever a full step overshoots to."""
    _, result = three_seeds
    one_unit = max(share / units for share, units in zip(RESNET20.flops_share, RESNET20.num_units))
    assert np.all(np.asarray(result.agent_met_target))
    budget = RESNET_CONFIG.flops_budget
    assert np.all(np.asarray(result.flops_kept) <= budget)
    assert np.all(np.asarray(result.flops_kept) >= budget - one_unit), (np.asarray(result.flops_kept), one_unit)


def test_best_episode_breaks_reward_ties_toward_more_flops_kept():
    """Rewards are accuracies on a few examples, so ties are common: among the steps that met the
    budget, the highest reward wins, and an equal reward goes to the one keeping more FLOPs."""
    from fedjax_sparse.agent import best_episode, better_episode
    rewards = jnp.array([50.0, 80.0, 80.0, 90.0, 80.0])
    flops = jnp.array([0.70, 0.75, 0.79, 0.80, 0.78])
    met = jnp.array([True, True, True, False, True])
    assert int(best_episode(rewards, flops, met)) == 2          # 90 missed the budget
    assert int(best_episode(rewards, flops, met.at[3].set(True))) == 3
    assert bool(better_episode(80.0, 0.79, 80.0, 0.75)) and not bool(better_episode(80.0, 0.74, 80.0, 0.75))
    assert bool(better_episode(81.0, 0.50, 80.0, 0.75)) and not bool(better_episode(79.0, 0.79, 80.0, 0.5))


def test_returned_ratios_always_meet_the_flops_target(three_seeds):
    """0.2 (`three_seeds`): the agent meets it. 0.95 needs ratios below p_min = .1, which no
    episode can reach: the largest uniform ratio meeting it comes back instead."""
    config = dataclasses.replace(RESNET_CONFIG, updates=2, flops_target=0.95)
    clients = [resnet_client(), resnet_client(2), resnet_client(5)]
    _, result = run_clients(config, clients, [3, 4, 5])
    for res, budget in [(three_seeds[1], RESNET_CONFIG.flops_budget), (result, config.flops_budget)]:
        assert np.all(np.asarray(res.flops_kept) <= budget)
        assert np.all(np.asarray(res.met_target))
        flops = jax.jit(jax.vmap(resnet_flops_kept, in_axes=(None, 0)))(None, res.keep_ratios)
        np.testing.assert_allclose(flops, res.flops_kept, rtol=1e-6)
    assert not np.any(np.asarray(result.agent_met_target))
    ratios = np.asarray(result.keep_ratios)
    np.testing.assert_array_equal(np.ptp(ratios, axis=1), 0.0)   # uniform
    assert np.all(ratios < config.min_keep_ratio)
    for c, client in enumerate(clients):
        # The largest such ratio: a little more breaks the budget.
        assert resnet_flops_kept(None, jnp.asarray(ratios[c] + 1e-3)) > config.flops_budget
        np.testing.assert_allclose(result.reward[c], 100 * resnet_accuracy(client, jnp.asarray(ratios[c])),
                                   rtol=1e-6)


def test_the_uniform_fallback_is_the_largest_uniform_ratio_within_the_budget():
    """ResNet-20 FLOPs with rounded unit counts: a step function of the ratio. At ratio 0 every
    layer keeps 1 unit, about 3.6% of the FLOPs; a smaller budget cannot be met (ratio 0)."""
    fallback = jax.jit(largest_uniform_keep_ratio, static_argnums=(0, 2))
    for budget in [1.0, 0.8, 0.5, 0.2, 0.05]:
        ratio = float(fallback(RESNET_ENV, None, 18, budget))
        assert resnet_flops_kept(None, jnp.full(18, ratio)) <= budget
        assert ratio == 1.0 or resnet_flops_kept(None, jnp.full(18, ratio + 1e-4)) > budget
    assert float(fallback(RESNET_ENV, None, 18, 0.01)) == 0.0


def test_vmapped_search_equals_a_loop_over_clients():
    config = RESNET_CONFIG
    clients = [resnet_client(), resnet_client(2), resnet_client(4)]
    agents, results = run_clients(config, clients, [7, 8, 9])
    for c, seed in enumerate([7, 8, 9]):
        agent, result = search_jit(init_agent(jax.random.key(seed), RESNET20, config), clients[c],
                                   jax.random.key(1000 + seed), env=RESNET_ENV, template=RESNET20,
                                   config=config)
        vmapped = tree_map(lambda x: x[c], (agents, results))
        # the final step lands on the FLOPs boundary by bisection to float32 resolution, where the two
        # programs may round a keep ratio differently by an ulp; Adam's second moments amplify that most
        # (on an AMD EPYC host one weight of 16 differed by 2.0e-5; the earlier hosts had met 1e-5)
        assert_trees_close((vmapped[0].params, vmapped[1]), (agent.params, result), atol=1e-4)
        assert_trees_close(vmapped[0].opt_state, agent.opt_state, rtol=1e-2)


def test_a_search_continues_from_the_agent_state_of_the_previous_one(bandit_search):
    """Two searches of 20 updates each, the second given the first's state and the key the first
    would have moved on to, are one search of 40 updates (with 1-step episodes no episode is
    in flight between updates). Were the state reset, the second search would start from fresh
    parameters and Adam moments."""
    initial, key, after_one_search, _ = bandit_search
    one = dataclasses.replace(BANDIT_CONFIG, updates=BANDIT_CONFIG.updates // 2)
    env_state = BANDIT_TARGETS
    run = functools.partial(search_jit, env=BANDIT_ENV, template=RESNET20, config=one)
    after_one, _ = run(initial, env_state, key)
    moved_on = key
    for _ in range(one.updates):     # each update splits off its rollout key (see `search`)
        moved_on = jax.random.split(moved_on)[0]
    after_two_searches, _ = run(after_one, env_state, moved_on)
    assert_trees_close(after_two_searches, after_one_search, atol=1e-6)
    assert int(after_two_searches.opt_state[0].count) == BANDIT_CONFIG.updates * one.epochs
    fresh, _ = run(initial, env_state, moved_on)
    with pytest.raises(AssertionError):
        assert_trees_close(fresh.params, after_two_searches.params, atol=1e-6)


# ------------------------------------------------------------------ configuration

@pytest.mark.parametrize("change, message", [
    ({"updates": 0}, "updates must be an integer >= 1, got 0"),
    ({"epochs": 2.5}, "epochs must be an integer >= 1, got 2.5"),
    ({"gamma": 0.0}, r"gamma must be in \(0.0, 1.0\], got 0.0"),
    ({"gae_lambda": 1.5}, r"gae_lambda must be in \[0.0, 1.0\], got 1.5"),
    ({"clip": 0.0}, "clip must be in"),
    ({"learning_rate": -1e-3}, "learning_rate must be in"),
    ({"action_std": 0.0}, "action_std must be in"),
    ({"min_keep_ratio": 0.0}, r"min_keep_ratio must be in \(0.0, 1.0\]"),
    ({"flops_target": 1.0}, r"flops_target must be in \(0.0, 1.0\), got 1.0"),
    ({"adam_b2": 1.0}, "adam_b2 must be in"),
    ({"penalty": float("nan")}, "penalty must be in"),
    ({"message_passing_steps": -1}, "message_passing_steps must be an integer >= 0"),
])
def test_bad_config_values_raise_one_line_errors(change, message):
    with pytest.raises(ValueError, match=message) as info:
        AgentConfig(**change)
    assert "\n" not in str(info.value)
