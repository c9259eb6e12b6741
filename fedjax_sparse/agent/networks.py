"""The agent's actor-critic: a graph network over the encoder's graph (SPATL eqs. 5-6).

Paper: g = GraphEncoder(G), a = mlp(g), with a in [0, 1]^N one sparsity ratio
per encoder layer; it names neither the graph encoder nor how one embedding
becomes N ratios. Our reading:

  * GraphEncoder: an embedding of nodes, edges and globals, then
    `message_passing_steps` residual `jraph.GraphNetwork` blocks (edge, node
    and global updates by two-layer MLPs over the concatenated inputs, mean
    aggregations so a node's scale does not grow with its degree).
  * Actor: a per-node MLP reads each node's embedding into one number,
    squashed by a sigmoid into the mean of the Gaussian over that layer's
    pruning fraction for this step (the official code squashes with tanh
    into [-1, 1] and then clips; a sigmoid maps onto the valid range
    directly). The standard deviation is fixed (paper: 0.5) and lives in the
    PPO code, not here.
  * Critic: its own graph encoder (the official code also keeps a separate
    critic), then an MLP over [mean of node embeddings, global embedding].
    Separate encoders keep the value loss, whose scale follows the rewards
    (up to 100), from steering the policy's features.

Every operation is per node, per edge, or a mean over them, so relabeling the
nodes permutes the actor's means the same way and leaves the value unchanged.
All functions take a single graph (`n_node` of length 1).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph


class MLP(nn.Module):
    """Dense layers with ReLU between them (none after the last)."""

    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, width in enumerate(self.widths):
            x = nn.Dense(width, name=f"dense{i}")(x)
            if i < len(self.widths) - 1:
                x = nn.relu(x)
        return x


class GraphEncoder(nn.Module):
    """Embeds every node, edge and the globals into `hidden_size` features by message passing."""

    hidden_size: int
    message_passing_steps: int

    @nn.compact
    def __call__(self, graph: jraph.GraphsTuple) -> jraph.GraphsTuple:
        width = self.hidden_size
        graph = jraph.GraphMapFeatures(
            embed_edge_fn=nn.Dense(width, name="embed_edges"),
            embed_node_fn=nn.Dense(width, name="embed_nodes"),
            embed_global_fn=nn.Dense(width, name="embed_globals"))(graph)
        for step in range(self.message_passing_steps):
            block = jraph.GraphNetwork(
                update_edge_fn=jraph.concatenated_args(MLP((width, width), name=f"edge_update{step}")),
                update_node_fn=jraph.concatenated_args(MLP((width, width), name=f"node_update{step}")),
                update_global_fn=jraph.concatenated_args(MLP((width, width), name=f"global_update{step}")),
                aggregate_edges_for_nodes_fn=jraph.segment_mean,
                aggregate_nodes_for_globals_fn=jraph.segment_mean,
                aggregate_edges_for_globals_fn=jraph.segment_mean)
            update = block(graph)
            graph = graph._replace(nodes=graph.nodes + update.nodes, edges=graph.edges + update.edges,
                                   globals=graph.globals + update.globals)
        return graph


class ActorCritic(nn.Module):
    """graph -> (means [L] in (0, 1) of the per-layer pruning fractions, value scalar)."""

    hidden_size: int
    message_passing_steps: int

    @nn.compact
    def __call__(self, graph: jraph.GraphsTuple) -> tuple[jax.Array, jax.Array]:
        actor_graph = GraphEncoder(self.hidden_size, self.message_passing_steps, name="actor_encoder")(graph)
        logits = MLP((self.hidden_size, 1), name="actor_head")(actor_graph.nodes)[:, 0]
        critic_graph = GraphEncoder(self.hidden_size, self.message_passing_steps, name="critic_encoder")(graph)
        pooled = jnp.concatenate([jnp.mean(critic_graph.nodes, axis=0), critic_graph.globals[0]])
        value = MLP((self.hidden_size, 1), name="critic_head")(pooled)[0]
        return nn.sigmoid(logits), value
