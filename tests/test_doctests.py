"""The building blocks' docstring examples run, as a reader would copy them."""

import doctest
import importlib

import pytest

MODULES = ("fedjax_sparse.building_blocks", "fedjax_sparse.core.messages.compression", "fedjax_sparse.core.messages.pricing",
           "fedjax_sparse.core.structure.model_parts", "fedjax_sparse.core.round.local_training",
           "fedjax_sparse.building_blocks.server_optimizer", "fedjax_sparse.core.structure.unit_masks")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
