"""Benchmarks of the library: `python -m benchmarks.NAME` from a clone, `fedjax-sparse benchmark NAME` from any
folder once the package is installed (this folder ships inside it as `fedjax_sparse.benchmarks`; its modules
import each other relatively, as `.common`, so that either name works).
"""

HELPERS = ("common", "fault_probes", "host_devices", "plugin_dists")  # modules the benchmarks use, no command of their own
# Benchmarks that run from a clone only, and why: `fedjax-sparse benchmark NAME` says this line instead.
CLONE_ONLY = {
    "before_after": "it unpacks an earlier commit from the clone's git history",
    "participation_cost": "it unpacks an earlier commit from the clone's git history",
    "client_scale": "its measuring processes start it again as the clone's top-level module benchmarks.client_scale",
    "fault_sweep": "its probes read the fault builders of the clone's tests/",
    "suite_compile": "it runs the clone's tests/",
    "parity": "it runs beside the authors' code, its PyTorch side in an environment of its own "
              "(benchmarks/parity/README.md); the package does not ship it",
}
