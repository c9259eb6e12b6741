"""A labelled image data set held on the host as compact uint8 arrays."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ImageDataset:
    """Train and test splits of one image-classification data set.

    Images are uint8 NHWC; a model sees `(x / 255 - mean) / std` per channel.
    `augment` marks CIFAR-like sets that get pad-4 random crop and horizontal
    flip during training.
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

    def __post_init__(self):
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dtype != np.uint8 or x.ndim != 4:
                raise ValueError(f"{self.name}: x_{split} must be uint8 NHWC, got {x.dtype} {x.shape}")
            if y.shape != (x.shape[0],):
                raise ValueError(f"{self.name}: y_{split} has shape {y.shape}, expected ({x.shape[0]},)")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(f"{self.name}: y_{split} labels outside [0, {self.num_classes})")
        if len(self.mean) != self.x_train.shape[-1] or len(self.std) != self.x_train.shape[-1]:
            raise ValueError(f"{self.name}: mean/std need one value per channel ({self.x_train.shape[-1]})")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])

    def subset(self, max_train: int | None, max_test: int | None, seed: int) -> "ImageDataset":
        """A random subset of each split (for quick runs); None keeps a split whole."""

        def pick(n, limit, salt):
            if limit is None or limit >= n:
                return np.arange(n)
            if limit < 1:
                raise ValueError(f"a subset needs at least one example, got {limit}")
            return np.sort(np.random.default_rng([seed, salt]).permutation(n)[:limit])

        train = pick(len(self.y_train), max_train, 0)
        test = pick(len(self.y_test), max_test, 1)
        return dataclasses.replace(self, x_train=self.x_train[train], y_train=self.y_train[train],
                                   x_test=self.x_test[test], y_test=self.y_test[test])
