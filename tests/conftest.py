import numpy as np
import pytest

from fedjax_sparse.data.federated import federated_split


def synthetic_split(counts, seed=0, shape=(8, 8, 1), num_classes=10):
    """A FederatedSplit of random images whose clients hold `counts` examples."""
    rng = np.random.default_rng(seed)
    total = int(sum(counts))
    x = rng.integers(0, 256, size=(total, *shape), dtype=np.uint8)
    y = rng.integers(0, num_classes, size=total).astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    indices = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(counts))]
    return federated_split(x, y, indices, mean=[0.5] * shape[-1], std=[0.25] * shape[-1])


@pytest.fixture
def make_split():
    return synthetic_split
