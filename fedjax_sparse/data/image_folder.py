"""Image folders as a `Dataset`: `ROOT/{train,test}/CLASS/*.{jpg,jpeg,png}`, decoded once (in
worker processes where forking is safe) and cached as .npy arrays keyed by the files' contents.

`load_image_folder` returns uint8 NHWC images, int32 labels (classes in sorted name order) and
per-channel mean/std computed on the training split in [0, 1] units. `stream_image_folder` gives the
same images chunk by chunk, for `fedjax-sparse convert` (`data.mapped`) of a folder larger than memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import numpy as np

from fedjax_sparse.data.array_cache import cache_base, channel_stats, content_key, load_arrays, save_arrays
from fedjax_sparse.data.dataset import ImageDataset
from fedjax_sparse.data.mapped import ChunkedSource, SplitSource

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
IMAGE_FOLDER_LAYOUT = "ROOT/{train,test}/CLASS_NAME/*.{jpg,jpeg,png}"
# Bump when the cache contents or their meaning change; old caches are then ignored.
_CACHE_FORMAT = 2
_GRAY_MODES = ("1", "L", "LA")


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


def _check_size(im, path: Path, reference: tuple[tuple[int, int], Path]) -> None:
    if im.size != reference[0]:
        raise ValueError(
            f"image {path} is {im.size[0]}x{im.size[1]} (WxH) but the first image {reference[1]} is "
            f"{reference[0][0]}x{reference[0][1]}; all images in an image folder must have one size"
        )


def _read_image(path: Path, reference: tuple[tuple[int, int], Path]) -> tuple[np.ndarray, bool]:
    """One image as an RGB uint8 [H, W, 3] array and whether it was grayscale.

    `reference` is (size, path) of the first image; every image must match its size.
    """
    from PIL import Image

    try:
        with Image.open(path) as im:
            _check_size(im, path, reference)
            gray = im.mode in _GRAY_MODES
            if gray:
                arr = np.asarray(im.convert("L"))
                return np.repeat(arr[..., None], 3, axis=-1), True
            return np.asarray(im if im.mode == "RGB" else im.convert("RGB")), False
    except OSError as err:  # unreadable or truncated: say which file
        raise OSError(f"cannot read image {path}: {err}") from err


def _is_gray(path: Path, reference: tuple[tuple[int, int], Path]) -> bool:
    """Whether `_read_image` finds the image grayscale, told from its header (no pixels decoded)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            _check_size(im, path, reference)
            return im.mode in _GRAY_MODES
    except OSError as err:
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
    """Decodes all `paths` to uint8 [N, H, W, 3], as one chunk of `_decode_chunks`; returns it and whether
    all were grayscale."""
    ((decoded, gray),) = _decode_chunks(paths, reference, num_workers, desc, progress, rows=len(paths))
    return decoded, gray


def _decode_chunks(
    paths: list[Path],
    reference: tuple[tuple[int, int], Path],
    num_workers: int,
    desc: str,
    progress: bool = True,
    *,
    rows: int,
):
    """Decodes `paths` in consecutive chunks of `rows` images, yielding each chunk (uint8 [rows, H, W, 3])
    with whether all its images were grayscale; a chunk is decoded only once the previous one was taken.

    With `num_workers` > 1 a chunk's pieces of 256 images go to a process pool
    of forked workers. Threads do not help: on CIFAR-sized JPEGs Pillow spends
    most of its time holding the GIL (measured: 2 threads were slower than 1).
    Fork is used, not spawn, so that user scripts need no `if __name__ ==
    "__main__"` guard; when fork is unsafe (JAX already initialised, or not
    Linux) decoding runs in this process instead.
    """
    from tqdm.auto import tqdm

    width, height = reference[0]
    piece = 256
    if num_workers > 1 and not _fork_is_safe():
        log.info("decoding in one process: forking workers is unsafe once JAX is initialised (or off Linux)")
        num_workers = 1
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=len(paths), desc=desc, unit="img", disable=not progress))
        pool = None
        if num_workers > 1:
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                num_workers, mp_context=multiprocessing.get_context("fork"), initializer=_ignore_interrupts))
        for start in range(0, len(paths), rows):
            chunk = paths[start : start + rows]
            out = np.empty((len(chunk), height, width, 3), dtype=np.uint8)
            all_gray = True
            starts = range(0, len(chunk), piece)
            if pool is None:
                for s in starts:
                    out[s : s + piece], gray = _decode_chunk(chunk[s : s + piece], reference)
                    all_gray &= gray
                    bar.update(len(chunk[s : s + piece]))
            else:
                futures = {pool.submit(_decode_chunk, chunk[s : s + piece], reference): s for s in starts}
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
                # the futures hold the workers' pieces: dropped, so the chunk is held once while it is written
                del futures, decoded
            yield out, all_gray


def _list_folder(root: str | os.PathLike
                 ) -> tuple[Path, tuple[str, ...], dict[str, list[str]], dict[str, np.ndarray]]:
    """The resolved root, the class names and, per split, the images' paths relative to the root (by class,
    then file name) and their int32 labels; a folder that is not `IMAGE_FOLDER_LAYOUT` is a one-line error."""
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
    return root, classes, relative, labels


def _reference(first: Path) -> tuple[tuple[int, int], Path]:
    """(size, path) of the first training image, which every image must match."""
    from PIL import Image

    with Image.open(first) as im:
        return im.size, first


def _workers(num_workers: int | None, total: int) -> int:
    """`num_workers`, by default all cores (at most 8), one below 1000 images (forking costs more)."""
    if num_workers is not None:
        return num_workers
    return 1 if total < 1000 else min(os.cpu_count() or 1, 8)


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
    root, classes, relative, labels = _list_folder(root)

    key = _cache_key(root, relative["train"] + relative["test"])
    directory = _cache_base(cache_dir) / key
    cached = _load_cache(directory, key)
    if cached is not None:
        arrays, meta = cached
        log.info("image folder %s: loaded decoded arrays from cache %s", root, directory)
        mean, std = tuple(meta["mean"]), tuple(meta["std"])
    else:
        flat = {split: [root / r for r in rel] for split, rel in relative.items()}
        reference = _reference(flat["train"][0])
        num_workers = _workers(num_workers, len(flat["train"]) + len(flat["test"]))
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


def stream_image_folder(root: str | os.PathLike, *, num_workers: int | None = None,
                        progress: bool = True) -> ChunkedSource:
    """The image folder `load_image_folder` loads, as chunks to write (`data.mapped.write_source`): the same
    images in the same order, colour and name, decoded a chunk at a time when the writer asks for it (file
    names and labels held; mean/std left to the writer, from the chunks). Whether the whole set is
    grayscale (1 channel) is told first from the images' headers, stopping at the first colour image;
    nothing is cached (the cache is the whole decoded set)."""
    root, classes, relative, labels = _list_folder(root)
    flat = {split: [root / r for r in rel] for split, rel in relative.items()}
    reference = _reference(flat["train"][0])
    gray = all(_is_gray(path, reference) for split in ("train", "test") for path in flat[split])
    num_workers = _workers(num_workers, len(flat["train"]) + len(flat["test"]))
    (width, height), channels = reference[0], 1 if gray else 3

    def split_source(split: str) -> SplitSource:
        def read(rows: int):
            for decoded, _ in _decode_chunks(flat[split], reference, num_workers, f"decoding {root.name}/{split}",
                                             progress, rows=rows):
                yield decoded[..., :1] if gray else decoded

        # a gray image is decoded to 3 channels before its first is kept: three times its bytes a chunk
        return SplitSource(y=labels[split], example_shape=(height, width, channels), dtype=np.dtype(np.uint8),
                           read=read, decoded_factor=3 if gray else 1)

    return ChunkedSource(name=f"imagefolder:{root}", num_classes=len(classes), class_names=classes,
                         augment=(height, width, channels) == (32, 32, 3), train=split_source("train"),
                         test=split_source("test"))
