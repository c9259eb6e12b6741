"""Loaders that turn classification data sets into a `Dataset` (`data.dataset`).

The image loaders here return uint8 NHWC images, int32 labels and per-channel mean/std
computed on the training split in [0, 1] units. Only `load_tfds` downloads,
and only a TFDS data set not yet prepared (once; `download=False` never); FEMNIST and
Shakespeare come from `data.leaf` (Flower's Hugging Face copies, prepared on first use
the same way, or a LEAF folder), FedProx's Synthetic(alpha, beta) from `data.synthetic`:

* `load_digits`        scikit-learn's bundled 8x8 digits (ships with sklearn).
* `load_image_folder`  `ROOT/{train,test}/CLASS/*.{jpg,jpeg,png}`, decoded once
                       and cached as .npy arrays.
* `load_tfds`          cifar10, cifar100, fashion_mnist, emnist, mnist from a
                       TensorFlow Datasets directory, prepared on first use
                       (`data.tfds_build`), read through tfds's array_record
                       data source (no TensorFlow needed to read).
* `load_dataset`       one string spec for all of the above and those.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import numpy as np

from fedjax_sparse.data import leaf, synthetic, tfds_build
from fedjax_sparse.data.array_cache import cache_base, channel_stats, content_key, load_arrays, save_arrays
from fedjax_sparse.data.dataset import ImageDataset

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
IMAGE_FOLDER_LAYOUT = "ROOT/{train,test}/CLASS_NAME/*.{jpg,jpeg,png}"
# Bump when the cache contents or their meaning change; old caches are then ignored.
_CACHE_FORMAT = 2
_GRAY_MODES = ("1", "L", "LA")


# ----------------------------------------------------------------------------
# scikit-learn digits


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> ImageDataset:
    """scikit-learn's bundled handwritten digits (1797 images, 8x8x1, 10 classes).

    Pixel values 0..16 become uint8 by round(v * 255 / 16). The train/test split
    is stratified and a pure function of `seed`: within each class a random
    `round(n_class * test_fraction)` examples go to test (at least one in each
    split when the class has two or more examples).
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
    bunch = _sk_load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    labels = bunch.target.astype(np.int32)

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
# Image folders


def _list_split(root: Path, split: str) -> tuple[list[str], list[list[str]]]:
    """Sorted class names and, per class, the sorted image file names."""
    split_dir = root / split
    if not split_dir.is_dir():
        raise FileNotFoundError(
            f"image folder split directory {split_dir} does not exist; expected layout {IMAGE_FOLDER_LAYOUT}"
        )
    with os.scandir(split_dir) as it:
        classes = sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
    files = []
    for name in classes:
        with os.scandir(split_dir / name) as it:
            entries = [e.name for e in it if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES]
        if not entries:
            raise ValueError(
                f"image folder class directory {split_dir / name} holds no .jpg/.jpeg/.png files; "
                f"expected layout {IMAGE_FOLDER_LAYOUT}"
            )
        files.append(sorted(entries))
    return classes, files


def _cache_key(root: Path, relative_paths: list[str]) -> str:
    """Hash of the relative file list and every file's bytes (`array_cache.content_key`): contents, not
    modification times, so a file replaced by one that keeps an older time (cp -p, tar, rsync -t)
    changes the key. Reading and hashing the 60,000 JPEGs of CIFAR-10 takes about 1 to 2 s on 2 CPU
    cores once they are in the page cache, about half of a cached load
    (benchmarks/results/image_cache_key.md)."""
    return content_key(root, relative_paths, _CACHE_FORMAT)


def _cache_base(cache_dir: str | os.PathLike | None) -> Path:
    return cache_base(cache_dir, "imagefolder")


def _load_cache(directory: Path, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """The cached arrays and meta, or None if missing, stale or unreadable."""
    return load_arrays(directory, key, _CACHE_FORMAT, ("x_train", "y_train", "x_test", "y_test"))


def _read_image(path: Path, reference: tuple[tuple[int, int], Path]) -> tuple[np.ndarray, bool]:
    """One image as an RGB uint8 [H, W, 3] array and whether it was grayscale.

    `reference` is (size, path) of the first image; every image must match its size.
    """
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.size != reference[0]:
                raise ValueError(
                    f"image {path} is {im.size[0]}x{im.size[1]} (WxH) but the first image {reference[1]} is "
                    f"{reference[0][0]}x{reference[0][1]}; all images in an image folder must have one size"
                )
            gray = im.mode in _GRAY_MODES
            if gray:
                arr = np.asarray(im.convert("L"))
                return np.repeat(arr[..., None], 3, axis=-1), True
            return np.asarray(im if im.mode == "RGB" else im.convert("RGB")), False
    except OSError as err:  # unreadable or truncated: say which file
        raise OSError(f"cannot read image {path}: {err}") from err


def _decode_chunk(paths: list[Path], reference: tuple[tuple[int, int], Path]) -> tuple[np.ndarray, bool]:
    """Decodes `paths` to uint8 [n, H, W, 3]; also returns whether all were grayscale."""
    width, height = reference[0]
    out = np.empty((len(paths), height, width, 3), dtype=np.uint8)
    all_gray = True
    for i, path in enumerate(paths):
        out[i], gray = _read_image(path, reference)
        all_gray &= gray
    return out, all_gray


def _fork_is_safe() -> bool:
    """Whether worker processes may be forked from this one.

    Only on Linux, and only while JAX has not started its backends: JAX's
    runtime threads make fork() unsafe and JAX warns about it. (Checked through
    a private JAX attribute; if that ever disappears we fork, and the worst case
    is JAX's warning, since the workers never touch JAX.)
    """
    if not sys.platform.startswith("linux"):
        return False
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    return not getattr(xla_bridge, "_backends", None)


def _ignore_interrupts() -> None:
    """In a decoding worker: Ctrl-C, which reaches the whole process group, is the parent's to handle
    (it cancels the pool); a worker forked from the command line would otherwise run its handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _decode_files(
    paths: list[Path],
    reference: tuple[tuple[int, int], Path],
    num_workers: int,
    desc: str,
    progress: bool = True,
) -> tuple[np.ndarray, bool]:
    """Decodes all `paths` to uint8 [N, H, W, 3]; returns it and whether all were grayscale.

    With `num_workers` > 1 the chunks go to a process pool of forked workers.
    Threads do not help: on CIFAR-sized JPEGs Pillow spends most of its time
    holding the GIL (measured: 2 threads were slower than 1). Fork is used, not
    spawn, so that user scripts need no `if __name__ == "__main__"` guard; when
    fork is unsafe (JAX already initialised, or not Linux) decoding runs in this
    process instead.
    """
    from tqdm.auto import tqdm

    width, height = reference[0]
    out = np.empty((len(paths), height, width, 3), dtype=np.uint8)
    chunk = 256
    starts = range(0, len(paths), chunk)
    all_gray = True
    if num_workers > 1 and not _fork_is_safe():
        log.info("decoding in one process: forking workers is unsafe once JAX is initialised (or off Linux)")
        num_workers = 1
    with tqdm(total=len(paths), desc=desc, unit="img", disable=not progress) as bar:
        if num_workers <= 1:
            for s in starts:
                out[s : s + chunk], gray = _decode_chunk(paths[s : s + chunk], reference)
                all_gray &= gray
                bar.update(len(paths[s : s + chunk]))
        else:
            context = multiprocessing.get_context("fork")
            with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=context,
                                                        initializer=_ignore_interrupts) as pool:
                futures = {pool.submit(_decode_chunk, paths[s : s + chunk], reference): s for s in starts}
                try:
                    for fut in concurrent.futures.as_completed(futures):
                        s = futures[fut]
                        decoded, gray = fut.result()
                        out[s : s + len(decoded)] = decoded
                        all_gray &= gray
                        bar.update(len(decoded))
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
    return out, all_gray


def load_image_folder(
    root: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    num_workers: int | None = None,
    progress: bool = True,
) -> ImageDataset:
    """Loads `ROOT/{train,test}/CLASS/*.{jpg,jpeg,png}` as an `ImageDataset`.

    * Classes are the sorted sub-directory names of `ROOT/train`; `ROOT/test`
      must have the same ones. Examples are ordered by class, then file name.
    * All images must have one size. Colour: if every image (both splits) is
      grayscale (PIL mode 1/L/LA) the result has 1 channel, otherwise every image
      is converted to RGB (grayscale replicated, alpha and palettes dropped by
      PIL's `convert("RGB")`).
    * Decoding happens once; the arrays are cached as .npy files in
      `BASE/imagefolder/<key>/` where BASE is `cache_dir`, else the environment
      variable FEDJAX_SPARSE_CACHE, else `~/.cache/fedjax_sparse`, and `<key>`
      hashes the relative file list and every file's contents (so a folder
      copied elsewhere shares its cache, and a replaced image never reads a
      stale one, whatever its times). Cache writes are atomic (temporary
      directory, then rename), so a killed run never leaves a half-written
      cache behind.
    * `num_workers` decoding processes (default: all cores, at most 8; one
      below 1000 images). Workers are forked, which needs Linux and a process
      that has not initialised JAX yet; otherwise decoding runs in-process (so
      load data before touching JAX for the fastest first load). `progress`
      shows a tqdm bar while decoding.
    * `augment` is True for 32x32 RGB data (CIFAR-like).
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder root {root} does not exist; expected layout {IMAGE_FOLDER_LAYOUT}")
    train_classes, train_files = _list_split(root, "train")
    test_classes, test_files = _list_split(root, "test")
    if not train_classes:
        raise ValueError(f"image folder {root / 'train'} has no class directories; expected layout {IMAGE_FOLDER_LAYOUT}")
    if train_classes != test_classes:
        only_train = sorted(set(train_classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(train_classes))
        raise ValueError(
            f"image folder {root}: train and test need the same class directories; "
            f"missing from test/: {only_train or 'none'}; missing from train/: {only_test or 'none'}"
        )
    classes = tuple(train_classes)

    relative = {
        split: [f"{split}/{c}/{f}" for c, fs in zip(classes, files) for f in fs]
        for split, files in (("train", train_files), ("test", test_files))
    }
    labels = {
        split: np.concatenate([np.full(len(fs), c, dtype=np.int32) for c, fs in enumerate(files)])
        for split, files in (("train", train_files), ("test", test_files))
    }

    key = _cache_key(root, relative["train"] + relative["test"])
    directory = _cache_base(cache_dir) / key
    cached = _load_cache(directory, key)
    if cached is not None:
        arrays, meta = cached
        log.info("image folder %s: loaded decoded arrays from cache %s", root, directory)
        mean, std = tuple(meta["mean"]), tuple(meta["std"])
    else:
        from PIL import Image

        flat = {split: [root / r for r in rel] for split, rel in relative.items()}
        with Image.open(flat["train"][0]) as first:
            reference = (first.size, flat["train"][0])
        total = len(flat["train"]) + len(flat["test"])
        if num_workers is None:
            num_workers = 1 if total < 1000 else min(os.cpu_count() or 1, 8)
        decoded, gray = {}, True
        for split in ("train", "test"):
            decoded[split], split_gray = _decode_files(
                flat[split], reference, num_workers, f"decoding {root.name}/{split}", progress
            )
            gray &= split_gray
        if gray:
            decoded = {s: np.ascontiguousarray(x[..., :1]) for s, x in decoded.items()}
        arrays = {
            "x_train": decoded["train"],
            "y_train": labels["train"],
            "x_test": decoded["test"],
            "y_test": labels["test"],
        }
        mean, std = channel_stats(arrays["x_train"])
        meta = {
            "format": _CACHE_FORMAT,
            "key": key,
            "root": str(root),
            "class_names": list(classes),
            "mean": list(mean),
            "std": list(std),
            "x_train_shape": list(arrays["x_train"].shape),
            "x_test_shape": list(arrays["x_test"].shape),
        }
        try:
            save_arrays(directory, arrays, meta, _CACHE_FORMAT)
            log.info("image folder %s: cached decoded arrays in %s", root, directory)
        except OSError as err:  # a read-only cache location must not stop training
            log.warning("could not write image-folder cache %s: %s", directory, err)

    x_train = arrays["x_train"]
    h, w, c = x_train.shape[1:]
    return ImageDataset(
        name=f"imagefolder:{root}",
        x_train=x_train,
        y_train=arrays["y_train"],
        x_test=arrays["x_test"],
        y_test=arrays["y_test"],
        num_classes=len(classes),
        class_names=classes,
        mean=mean,
        std=std,
        augment=(h, w, c) == (32, 32, 3),
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


def _read_source(source, desc: str, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """All images and labels of one tfds data source as uint8 / int32 arrays."""
    from tqdm.auto import tqdm

    n = len(source)
    first = source[0] if n else None
    shape = first["image"].shape if n else (0, 0, 0)
    x = np.empty((n, *shape), dtype=np.uint8)
    y = np.empty((n,), dtype=np.int32)
    # Record-by-record reads: about as fast as tfds's batched __getitems__ here,
    # and they also work with tfds.testing.mock_data, whose mocked __getitems__
    # is broken in tfds 4.9.x.
    for i in tqdm(range(n), desc=desc, unit="img", disable=not progress):
        ex = first if i == 0 else source[i]
        x[i] = ex["image"]
        y[i] = ex["label"]
    return x, y


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

    x_train, y_train = _read_source(train_src, f"reading {tfds_name}/train", progress)
    x_test, y_test = _read_source(test_src, f"reading {tfds_name}/test", progress)
    if tfds_name.startswith("emnist"):
        x_train = np.ascontiguousarray(x_train.transpose(0, 2, 1, 3))
        x_test = np.ascontiguousarray(x_test.transpose(0, 2, 1, 3))
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


# ----------------------------------------------------------------------------
# One entry point


class DataError(ValueError):
    """A data set could not be loaded; the message is one line saying why."""


DATASET_SPECS = ("digits", *TFDS_DATASETS, "imagefolder:PATH", "femnist", "shakespeare", "leaf:PATH",
                 synthetic.SPEC)


def is_generated(spec: str) -> bool:
    """Whether `spec` names a generated population (its clients made on demand, `data.synthetic`)."""
    return spec.startswith("synthetic:")


def has_own_clients(spec: str) -> bool:
    """Whether the data set `spec` names has its own clients (`--partition natural`), told from the spec."""
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
    'imagefolder:PATH', 'femnist', 'shakespeare', 'leaf:PATH' or 'synthetic:ALPHA,BETA'.

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
