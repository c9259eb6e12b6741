"""A labelled data set held on the host as compact arrays, with its own clients where it has them.

Three kinds of examples, told apart by their dtype (`example_kind`):
  * 'image':    uint8 NHWC images; a model sees `(x / 255 - mean) / std` per channel, and CIFAR-like
                sets are augmented (`data.federated.normalize`);
  * 'features': float32 feature vectors [N, D], seen as they are (FedProx's Synthetic(alpha, beta));
  * 'tokens':   int32 token sequences [N, T], seen as they are (Shakespeare's 80 characters).
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = {np.dtype(np.uint8): "image", np.dtype(np.float32): "features", np.dtype(np.int32): "tokens"}


def example_kind(x) -> str:
    """'image', 'features' or 'tokens' for an array of examples (by its dtype); ValueError otherwise."""
    kind = KINDS.get(np.dtype(x.dtype))
    if kind is None:
        raise ValueError(f"examples must be uint8 images, float32 features or int32 tokens, got {x.dtype}")
    return kind


_RANKS = {"image": (4, "NHWC"), "features": (2, "[N, features]"), "tokens": (2, "[N, tokens]")}


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and test splits of one classification data set.

    `augment` marks CIFAR-like image sets that get pad-4 random crop and horizontal flip
    during training. `mean`/`std` are per channel for images and empty otherwise.
    `train_clients`/`test_clients` ([n] int, optional): the client (writer, speaking role) of
    every example, for data sets that have their own clients (`--partition natural`);
    `client_names` names client c (LEAF's user id).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False
    train_clients: np.ndarray | None = None
    test_clients: np.ndarray | None = None
    client_names: tuple[str, ...] | None = None

    def __post_init__(self):
        kind = example_kind(self.x_train)
        rank, layout = _RANKS[kind]
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dtype != self.x_train.dtype or x.ndim != rank:
                what = "uint8 NHWC" if kind == "image" else f"{self.x_train.dtype} {layout}"
                raise ValueError(f"{self.name}: x_{split} must be {what}, got {x.dtype} {x.shape}")
            if y.shape != (x.shape[0],):
                raise ValueError(f"{self.name}: y_{split} has shape {y.shape}, expected ({x.shape[0]},)")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(f"{self.name}: y_{split} labels outside [0, {self.num_classes})")
            clients = getattr(self, f"{split}_clients")
            if clients is not None and np.shape(clients) != (x.shape[0],):
                raise ValueError(f"{self.name}: {split}_clients has shape {np.shape(clients)}, expected "
                                 f"({x.shape[0]},)")
        channels = self.x_train.shape[-1] if kind == "image" else 0
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"{self.name}: mean/std need one value per image channel ({channels})")
        if kind != "image" and self.augment:
            raise ValueError(f"{self.name}: only images are augmented")
        if (self.train_clients is None) != (self.test_clients is None):
            raise ValueError(f"{self.name}: give the clients of both splits or of neither")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def kind(self) -> str:
        return example_kind(self.x_train)

    @property
    def has_clients(self) -> bool:
        """Whether the data set has its own clients (`--partition natural`)."""
        return self.train_clients is not None

    def subset(self, max_train: int | None, max_test: int | None, seed: int) -> "Dataset":
        """A random subset of each split (for quick runs); None keeps a split whole."""

        def pick(n, limit, salt):
            if limit is None or limit >= n:
                return np.arange(n)
            if limit < 1:
                raise ValueError(f"a subset needs at least one example, got {limit}")
            return np.sort(np.random.default_rng([seed, salt]).permutation(n)[:limit])

        train = pick(len(self.y_train), max_train, 0)
        test = pick(len(self.y_test), max_test, 1)
        clients = {} if not self.has_clients else {"train_clients": self.train_clients[train],
                                                   "test_clients": self.test_clients[test]}
        return dataclasses.replace(self, x_train=self.x_train[train], y_train=self.y_train[train],
                                   x_test=self.x_test[test], y_test=self.y_test[test], **clients)


ImageDataset = Dataset  # the name from when every data set held images
