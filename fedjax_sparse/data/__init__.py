"""Data sets, client partitions and augmentation for fedjax_sparse."""

from fedjax_sparse.data.augment import random_crop_flip
from fedjax_sparse.data.dataset import Dataset, ImageDataset
from fedjax_sparse.data.partition import (
    dirichlet_partition,
    iid_partition,
    label_partition,
    local_test_split,
    natural_partition,
    partition,
    partition_summary,
    stratified_holdout,
)
from fedjax_sparse.data.sources import (
    DataError,
    load_dataset,
    load_digits,
    load_image_folder,
    load_tfds,
)

__all__ = [
    "DataError",
    "Dataset",
    "ImageDataset",
    "dirichlet_partition",
    "iid_partition",
    "label_partition",
    "load_dataset",
    "load_digits",
    "load_image_folder",
    "load_tfds",
    "local_test_split",
    "natural_partition",
    "partition",
    "partition_summary",
    "random_crop_flip",
    "stratified_holdout",
]
