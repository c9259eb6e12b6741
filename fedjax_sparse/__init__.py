"""fedjax_sparse: communication-efficient, sparse federated learning in JAX."""

__version__ = "0.1.0"
