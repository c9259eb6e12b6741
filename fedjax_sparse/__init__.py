"""fedjax_sparse: communication-efficient, sparse federated learning in JAX.

The import paths of the library's modules before core/ was arranged in rooms by concern (issue 56) keep working:
`fedjax_sparse.core.algorithm` is `fedjax_sparse.core.contract.algorithm`, `fedjax_sparse.core.local_training` is
`fedjax_sparse.core.round.local_training`, and so on (`MOVED`); a module is imported under its old name only when
asked for.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

MOVED = {
    "fedjax_sparse.algorithms.differential_privacy": "fedjax_sparse.privacy.mechanism",
    "fedjax_sparse.core.aggregation": "fedjax_sparse.core.messages.aggregation",
    "fedjax_sparse.core.algorithm": "fedjax_sparse.core.contract.algorithm",
    "fedjax_sparse.core.buffered_round": "fedjax_sparse.core.round.buffered",
    "fedjax_sparse.core.capacity": "fedjax_sparse.core.federation.capacity",
    "fedjax_sparse.core.client_rows": "fedjax_sparse.core.client_state.rows",
    "fedjax_sparse.core.client_store": "fedjax_sparse.core.client_state.store",
    "fedjax_sparse.core.clock": "fedjax_sparse.core.federation.clock",
    "fedjax_sparse.core.compilation": "fedjax_sparse.core.round.compilation",
    "fedjax_sparse.core.compression": "fedjax_sparse.core.messages.compression",
    "fedjax_sparse.core.control_variates": "fedjax_sparse.building_blocks.control_variates",
    "fedjax_sparse.core.cpu_evaluation": "fedjax_sparse.core.evaluation.cpu",
    "fedjax_sparse.core.cpu_round": "fedjax_sparse.core.round.cpu",
    "fedjax_sparse.core.device_split": "fedjax_sparse.core.round.device_split",
    "fedjax_sparse.core.distributed": "fedjax_sparse.core.round.distributed",
    "fedjax_sparse.core.flops": "fedjax_sparse.core.structure.flops",
    "fedjax_sparse.core.layer_groups": "fedjax_sparse.core.structure.layer_groups",
    "fedjax_sparse.core.local_training": "fedjax_sparse.core.round.local_training",
    "fedjax_sparse.core.model_parts": "fedjax_sparse.core.structure.model_parts",
    "fedjax_sparse.core.numerics": "fedjax_sparse.core.round.numerics",
    "fedjax_sparse.core.options": "fedjax_sparse.core.contract.options",
    "fedjax_sparse.core.participation": "fedjax_sparse.core.federation.participation",
    "fedjax_sparse.core.privacy_accounting": "fedjax_sparse.privacy.accounting",
    "fedjax_sparse.core.quiet_logs": "fedjax_sparse.console",
    "fedjax_sparse.core.round_driver": "fedjax_sparse.core.round.driver",
    "fedjax_sparse.core.secure_aggregation": "fedjax_sparse.core.messages.secure_aggregation",
    "fedjax_sparse.core.server_optimizer": "fedjax_sparse.building_blocks.server_optimizer",
    "fedjax_sparse.core.store_evaluation": "fedjax_sparse.core.evaluation.store",
    "fedjax_sparse.core.store_round": "fedjax_sparse.core.round.store",
    "fedjax_sparse.core.store_snapshots": "fedjax_sparse.core.client_state.snapshots",
    "fedjax_sparse.core.streams": "fedjax_sparse.core.round.streams",
    "fedjax_sparse.core.unit_masks": "fedjax_sparse.core.structure.unit_masks",
    "fedjax_sparse.core.unit_selection": "fedjax_sparse.core.structure.unit_selection",
    "fedjax_sparse.core.wrapping": "fedjax_sparse.core.contract.wrapping",
    "fedjax_sparse.run.privacy": "fedjax_sparse.privacy.ledger",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module asked for by its path before the move as the module it became."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):  # the module it became is imported already
        pass


sys.meta_path.append(_Moved())
