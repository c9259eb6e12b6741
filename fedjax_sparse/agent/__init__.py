"""SPATL's salient-parameter selection agent: graph, GNN actor-critic, PPO and the per-round search."""

from fedjax_sparse.agent.config import AgentConfig
from fedjax_sparse.agent.graph import (NUM_NORM_STATS, GraphTemplate, graph_state,
                                       unit_norm_statistics)
from fedjax_sparse.agent.networks import ActorCritic, GraphEncoder
from fedjax_sparse.agent.ppo import Transition, generalized_advantages, ppo_loss, ppo_update
from fedjax_sparse.agent.search import (AgentState, Observation, PruningEnv, SearchResult, best_episode,
                                        better_episode, init_agent, largest_uniform_keep_ratio, load_agent,
                                        policy_fn, save_agent, search, search_clients)

__all__ = ['NUM_NORM_STATS', 'GraphTemplate', 'graph_state', 'unit_norm_statistics',
           'ActorCritic', 'GraphEncoder', 'Transition', 'generalized_advantages', 'ppo_loss', 'ppo_update',
           'AgentConfig', 'AgentState', 'Observation', 'PruningEnv', 'SearchResult', 'best_episode',
           'better_episode', 'init_agent',
           'largest_uniform_keep_ratio', 'load_agent', 'policy_fn', 'save_agent', 'search', 'search_clients']
