import flax.linen as nn
import numpy as np
import pytest

from fedjax_sparse.models import Model, ModelStructure

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


LINEAR_CLASSES = 3


class _Linear(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train, mask=None, unit_masks=None):
        del train, mask, unit_masks
        return nn.Dense(self.num_classes, name="fc")(x.reshape(x.shape[0], -1))


def linear_model() -> Model:
    """A linear softmax model on 2x2x1 inputs with 3 classes, simple enough to differentiate by hand."""
    return Model(name="linear", module=_Linear(LINEAR_CLASSES), input_shape=(2, 2, 1), num_classes=LINEAR_CLASSES,
                 structure=ModelStructure(()))
