"""Paper settings as runnable modules: `python -m experiments.NAME [--quick]` from a clone, `fedjax-sparse
experiment NAME [--quick]` from any folder once the package is installed (this folder ships inside it as
`fedjax_sparse.experiments`; its modules import each other relatively, as `.common`, so that either name works).
"""

HELPERS = ("common",)  # modules the experiments use, no command of their own
