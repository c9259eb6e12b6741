"""Loaders that turn classification data sets into a `Dataset` (`data.dataset`).

The image loaders here return uint8 NHWC images, int32 labels and per-channel mean/std
computed on the training split in [0, 1] units. Only `load_tfds` downloads,
and only a TFDS data set not yet prepared (once; `download=False` never); FEMNIST and
Shakespeare come from `data.leaf` (Flower's Hugging Face copies, prepared on first use
the same way, or a LEAF folder), FedProx's Synthetic(alpha, beta) from `data.synthetic`:

* `load_digits`        scikit-learn's bundled 8x8 digits (ships with sklearn).
* `load_image_folder`  `ROOT/{train,test}/CLASS/*.{jpg,jpeg,png}`, decoded once
                       and cached as .npy arrays (`data.image_folder`).
* `load_tfds`          cifar10, cifar100, fashion_mnist, emnist, mnist from a
                       TensorFlow Datasets directory, prepared on first use
                       (`data.tfds_build`), read through tfds's array_record
                       data source (no TensorFlow needed to read).
* `load_dataset`       one string spec for all of the above and those.
* `stream_dataset`     an image folder or a TFDS data set as chunks to write
                       (`fedjax-sparse convert`, `data.mapped`), never held whole.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import numpy as np

from fedjax_sparse.data import leaf, mapped, synthetic, tfds_build
from fedjax_sparse.data.array_cache import channel_stats
from fedjax_sparse.data.dataset import ImageDataset
from fedjax_sparse.data.image_folder import load_image_folder, stream_image_folder

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------
# scikit-learn digits


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels [1797, 64] in 0..16, labels) as scikit-learn ships them (`datasets/data/digits.csv.gz`), read
    without importing scikit-learn: importing it (and SciPy with it) costs a second, in every process a run
    starts. A scikit-learn that keeps the file elsewhere is asked through its own loader."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ModuleNotFoundError("the digits data set ships with scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits as sklearn_digits

        bunch = sklearn_digits()
        return bunch.data, bunch.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> ImageDataset:
    """scikit-learn's bundled handwritten digits (1797 images, 8x8x1, 10 classes).

    Pixel values 0..16 become uint8 by round(v * 255 / 16). The train/test split
    is stratified and a pure function of `seed`: within each class a random
    `round(n_class * test_fraction)` examples go to test (at least one in each
    split when the class has two or more examples).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
    pixels, labels = _digits_arrays()
    images = np.round(pixels.reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = labels.astype(np.int32)

    rng = np.random.default_rng(seed)
    test_parts = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(len(idx) * test_fraction))
        if len(idx) >= 2:
            n_test = min(max(n_test, 1), len(idx) - 1)
        test_parts.append(idx[:n_test])
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[np.concatenate(test_parts)] = True
    train_idx, test_idx = np.flatnonzero(~is_test), np.flatnonzero(is_test)

    x_train = images[train_idx]
    mean, std = channel_stats(x_train)
    return ImageDataset(
        name="digits",
        x_train=x_train,
        y_train=labels[train_idx],
        x_test=images[test_idx],
        y_test=labels[test_idx],
        num_classes=10,
        class_names=tuple(str(i) for i in range(10)),
        mean=mean,
        std=std,
        augment=False,
    )


# ----------------------------------------------------------------------------
# TensorFlow Datasets

# Our name -> (tfds name, augment). 'emnist' is the 'balanced' configuration:
# 47 classes, 112,800 train / 18,800 test, balanced over classes.
TFDS_DATASETS = {
    "cifar10": ("cifar10", True),
    "cifar100": ("cifar100", True),
    "fashion_mnist": ("fashion_mnist", False),
    "emnist": ("emnist/balanced", False),
    "mnist": ("mnist", False),
}


def _read_records(source, start: int, stop: int, labels: np.ndarray, bar) -> np.ndarray:
    """Records [start, stop) of one tfds data source: their images as uint8 [stop - start, ...]; their labels
    go to `labels[start:stop]`."""
    x = None
    # Record-by-record reads: about as fast as tfds's batched __getitems__ here,
    # and they also work with tfds.testing.mock_data, whose mocked __getitems__
    # is broken in tfds 4.9.x.
    for i in range(start, stop):
        ex = source[i]
        if x is None:
            x = np.empty((stop - start, *ex["image"].shape), dtype=np.uint8)
        x[i - start] = ex["image"]
        labels[i] = ex["label"]
        bar.update(1)
    return x


def _upright(x: np.ndarray, tfds_name: str) -> np.ndarray:
    """EMNIST's images are stored transposed in tfds: transposed back; any other's as they are."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if tfds_name.startswith("emnist") else x


def _read_source(source, desc: str, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """All images and labels of one tfds data source as uint8 / int32 arrays."""
    from tqdm.auto import tqdm

    n = len(source)
    y = np.empty((n,), dtype=np.int32)
    with tqdm(total=n, desc=desc, unit="img", disable=not progress) as bar:
        x = _read_records(source, 0, n, y, bar) if n else np.empty((0, 0, 0, 0), dtype=np.uint8)
    return x, y


def _stream_source(source, tfds_name: str, image_shape: tuple, desc: str, progress: bool) -> mapped.SplitSource:
    """One tfds data source as a split to write: its records read a chunk at a time, by index, when the
    writer asks (labels filled as they are read)."""
    from tqdm.auto import tqdm

    n = len(source)
    labels = np.empty((n,), dtype=np.int32)

    def read(rows: int):
        with tqdm(total=n, desc=desc, unit="img", disable=not progress) as bar:
            for start in range(0, n, rows):
                yield _upright(_read_records(source, start, min(n, start + rows), labels, bar), tfds_name)

    shape = _upright(np.empty((0, *image_shape), np.uint8), tfds_name).shape[1:]
    return mapped.SplitSource(y=labels, example_shape=shape, dtype=np.dtype(np.uint8), read=read)


def _open_tfds(name: str, data_dir, download: bool, progress: bool):
    """(tfds name, augment, builder, train source, test source) of one of `TFDS_DATASETS` or 'emnist/CONFIG',
    prepared first where `download` allows (`load_tfds`)."""
    if name in TFDS_DATASETS:
        tfds_name, augment = TFDS_DATASETS[name]
    elif name.startswith("emnist/"):
        tfds_name, augment = name, False
    else:
        raise ValueError(f"unknown tfds data set {name!r}; valid: {', '.join(TFDS_DATASETS)} or 'emnist/CONFIG'")
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            f"loading {name!r} needs tensorflow-datasets (pip install tensorflow-datasets array_record); "
            "TensorFlow itself is not required for reading"
        ) from err

    builder = tfds.builder(tfds_name, data_dir=data_dir, try_gcs=False)
    if download and not builder.is_prepared():
        tfds_build.prepare(builder, tfds_name, progress=progress)
        builder = tfds.builder(tfds_name, data_dir=data_dir, try_gcs=False)  # reads the new dataset_info.json
    build_hint = (
        f"run `tfds build {tfds_name} --file_format=array_record"
        + (f" --data_dir {data_dir}`" if data_dir else "`")
        + " first (building needs TensorFlow; reading does not), or pass data_dir= pointing at prepared data"
    )
    try:
        train_src, test_src = builder.as_data_source(split=["train", "test"])
    except Exception as err:  # tfds raises several types here; translate them into one clear message
        if not builder.is_prepared():
            raise FileNotFoundError(
                f"tfds data set {tfds_name!r} is not prepared under {builder.data_dir} (--no-download: nothing is "
                f"downloaded); {build_hint}"
            ) from err
        raise RuntimeError(
            f"tfds data set {tfds_name!r} at {builder.data_dir} cannot be read without TensorFlow "
            f"(it must be prepared in the array_record format, found {builder.info.file_format}); {build_hint}: {err}"
        ) from err
    return tfds_name, augment, builder, train_src, test_src


def load_tfds(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = True,
              progress: bool = True) -> ImageDataset:
    """cifar10, cifar100, fashion_mnist, emnist or mnist from a TFDS data directory.

    `data_dir` defaults to TFDS's own ($TFDS_DATA_DIR, else ~/tensorflow_datasets).
    A data set not prepared there is prepared on this first use with TFDS's own
    download and build, in the array_record format, showing TFDS's progress
    (`data.tfds_build`: building needs the [tfds] extra; reading does not);
    later uses read it. `download=False` only reads, raising FileNotFoundError
    for unprepared data. Reading goes through `builder.as_data_source()`
    (tfds's array_record backend), which needs neither TensorFlow nor the network.

    'emnist' means tfds's 'emnist/balanced' (47 classes; other configs can be
    named as 'emnist/CONFIG'). EMNIST images are stored transposed in tfds; they
    are transposed back to upright here. `augment` is True for cifar10/cifar100.
    """
    tfds_name, augment, builder, train_src, test_src = _open_tfds(name, data_dir, download, progress)
    x_train, y_train = _read_source(train_src, f"reading {tfds_name}/train", progress)
    x_test, y_test = _read_source(test_src, f"reading {tfds_name}/test", progress)
    x_train, x_test = _upright(x_train, tfds_name), _upright(x_test, tfds_name)
    label_feature = builder.info.features["label"]
    mean, std = channel_stats(x_train)
    return ImageDataset(
        name=name,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=int(label_feature.num_classes),
        class_names=tuple(label_feature.names),
        mean=mean,
        std=std,
        augment=augment,
    )


def stream_tfds(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = True,
                progress: bool = True) -> mapped.ChunkedSource:
    """The data set `load_tfds` loads, as chunks to write (`data.mapped.write_source`): the same records in
    the same order (read by index from the data source, a chunk at a time, EMNIST's transposed back chunk
    by chunk), labels held; mean/std left to the writer. The image shape is the tfds feature's (every
    chunk is checked against it as written)."""
    tfds_name, augment, builder, train_src, test_src = _open_tfds(name, data_dir, download, progress)
    label_feature = builder.info.features["label"]
    image_shape = tuple(builder.info.features["image"].shape)
    return mapped.ChunkedSource(
        name=name, num_classes=int(label_feature.num_classes), class_names=tuple(label_feature.names),
        augment=augment,
        train=_stream_source(train_src, tfds_name, image_shape, f"reading {tfds_name}/train", progress),
        test=_stream_source(test_src, tfds_name, image_shape, f"reading {tfds_name}/test", progress))


# ----------------------------------------------------------------------------
# One entry point


class DataError(ValueError):
    """A data set could not be loaded; the message is one line saying why."""


DATASET_SPECS = ("digits", *TFDS_DATASETS, "imagefolder:PATH", "femnist", "shakespeare", "leaf:PATH",
                 synthetic.SPEC, "mmap:FOLDER")


def is_generated(spec: str) -> bool:
    """Whether `spec` names a generated population (its clients made on demand, `data.synthetic`)."""
    return spec.startswith("synthetic:")


def has_own_clients(spec: str) -> bool:
    """Whether the data set `spec` names has its own clients (`--partition natural`), told from the spec."""
    if spec.startswith(mapped.PREFIX):
        return mapped.has_clients(spec[len(mapped.PREFIX):])
    return is_generated(spec) or spec in leaf.HUGGING_FACE or spec.startswith("leaf:")


def load_dataset(
    spec: str,
    *,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    download: bool = True,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    num_clients: int | None = None,
    population_seed=None,
) -> ImageDataset | synthetic.Synthetic:
    """Loads a data set by spec: 'digits', 'cifar10', 'cifar100', 'fashion_mnist', 'emnist', 'mnist',
    'imagefolder:PATH', 'femnist', 'shakespeare', 'leaf:PATH', 'synthetic:ALPHA,BETA' or 'mmap:FOLDER'
    (a data set converted to memory-mapped files, `data.mapped`).

    `seed` only affects 'digits' (its train/test split); `data_dir` is the tfds
    data directory and `download` whether a tfds data set not prepared there is
    prepared now (`load_tfds`); for 'femnist' and 'shakespeare' the same for their
    Hugging Face preparation (`data.leaf`, under DATA_DIR/leaf); `cache_dir` is the
    image-folder and LEAF-folder cache base. A generated population
    ('synthetic:ALPHA,BETA', `data.synthetic`) has `num_clients` clients, drawn from
    `population_seed` (a numpy seed or seed sequence), and costs nothing until read.
    """
    try:
        if is_generated(spec):
            alpha, beta = synthetic.parse_spec(spec)
            if num_clients is None:
                raise ValueError(f"{spec} is a generated population: give its number of clients")
            return synthetic.Synthetic(alpha, beta, 0 if population_seed is None else population_seed,
                                       int(num_clients))
        if spec.startswith(mapped.PREFIX) and spec[len(mapped.PREFIX):]:
            return mapped.open_mapped(spec[len(mapped.PREFIX):])
        if spec in leaf.HUGGING_FACE:
            return leaf.load_hugging_face(spec, data_dir, download=download)
        if spec.startswith("leaf:") and spec[len("leaf:"):]:
            return leaf.read_leaf(spec[len("leaf:"):], cache_dir=cache_dir)
        if spec == "digits":
            return load_digits(seed=seed)
        if spec in TFDS_DATASETS:
            return load_tfds(spec, data_dir=data_dir, download=download, progress=progress)
        if spec.startswith("imagefolder:") and spec[len("imagefolder:") :]:
            return load_image_folder(spec[len("imagefolder:") :], cache_dir=cache_dir, progress=progress)
    except (ValueError, OSError, RuntimeError, ImportError) as err:  # OSError: missing or unreadable files, offline
        raise DataError(f"cannot load data set {spec!r}: {' '.join(str(err).split())}") from err
    raise DataError(f"unknown data set spec {spec!r}; valid forms: {', '.join(DATASET_SPECS)}")


def stream_dataset(spec: str, *, data_dir: str | os.PathLike | None = None, download: bool = True,
                   progress: bool = True) -> mapped.ChunkedSource | None:
    """The data set `spec` as chunks to write (`data.convert.convert`) where its loader reads it in pieces: an
    image folder (`stream_image_folder`) or a TFDS data set (`stream_tfds`); None for a source that is
    loaded whole (`digits`, tiny; LEAF, whose example order needs every file first, `data.leaf`; a
    Hugging Face copy, held as prepared arrays). `data_dir`, `download`, `progress` as for `load_dataset`."""
    try:
        if spec in TFDS_DATASETS:
            return stream_tfds(spec, data_dir=data_dir, download=download, progress=progress)
        if spec.startswith("imagefolder:") and spec[len("imagefolder:") :]:
            return stream_image_folder(spec[len("imagefolder:") :], progress=progress)
    except (ValueError, OSError, RuntimeError, ImportError) as err:  # as `load_dataset` says them
        raise DataError(f"cannot load data set {spec!r}: {' '.join(str(err).split())}") from err
    return None
