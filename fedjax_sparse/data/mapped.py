"""Client data larger than memory: a data set written once as a folder of .npy files, memory-mapped
when a run reads it (`--dataset mmap:FOLDER`).

The folder holds what a `Dataset` holds, split by split, in the source's own example order:
  manifest.json          format, version, name, classes, per-channel mean/std, augment, each split's
                         examples, example shape and dtype, and content digest, whether it has clients
  {train,test}_x.npy     the examples (uint8 NHWC images, float32 features or int32 tokens)
  {train,test}_y.npy     int32 labels
  {train,test}_clients.npy  each example's own client (LEAF's user), where the source has clients
The manifest is written last, so a folder whose conversion was cut short has none and is refused.
A conversion writes only into an empty or new folder, or one a conversion cut short left (it marks
the folder first, `WRITING`): a folder holding anything else (the user's own files, which it would
overwrite) is refused in one line naming them.

Keeping the source's order (rather than one client after another) lets every `--partition` split the
folder exactly as it splits the source in memory, from the labels alone: a run on `mmap:FOLDER` is the
run on the source, figure for figure. What a run holds in memory is the labels, the clients' example
indices (8 bytes an example) and the global test set (evaluated whole, as for any data set); the
training and local test examples stay on disk. Each process reads only the rows of the clients it
owns (`ProcessLayout`, id % P), and only when a round samples them or an evaluation scores them:
`MappedHostData` is `windows.HostData` whose examples are gathered from the file by row index.
The gather reads rows with positioned reads (one per run of consecutive rows) rather than through
the map: a page touched through a map joins the process's resident set, with the pages the kernel
maps around it (readahead, fault-around: 64 KB and more per touched row of a scattered client),
and stays there until the map closes; measured, 3 rounds over 4 i.i.d. clients of 0.3 GB put
0.45 GB of file pages in the resident set. Read, only the rows asked for are copied in. The
device store and a `--max-train-examples` subset read through the map (they hold their rows).

`convert(spec, folder)` (`fedjax-sparse convert SPEC FOLDER`) writes a `--dataset` spec: an image
folder (`imagefolder:PATH`), LEAF JSON (`leaf:PATH`, `femnist`, `shakespeare`), a TFDS data set
(`cifar10`, `mnist`, ...) or `digits`, into the folder `save_mapped(load_dataset(spec))` writes, byte
for byte. An image folder and a TFDS data set are streamed, so a source larger than memory converts:
their loaders' chunk readers (`data.sources.stream_dataset`, a `ChunkedSource`) hold the labels (and an
image folder's file names) and decode the examples one chunk of `_CHUNK_BYTES` (64 MiB) at a time,
when `write_source` asks for it, which writes it before asking for the next. The training split's
per-channel mean/std is then summed from the chunks' pixel histograms (`array_cache.channel_histograms`:
integer counts, so the figures are `channel_stats`'s on the whole split, bit for bit). `digits` (1797
8x8 images) and LEAF are loaded whole by their own loaders and written from memory (LEAF's example
order needs every file first, `data.leaf`). Any other source larger than memory is written with
`write_split` from chunks the caller makes (benchmarks/larger_than_memory.py writes its synthetic set
that way).
The content digests are the run fingerprint's (`run.fingerprint`), computed while writing, so a
resumed run checks its data without reading the examples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from fedjax_sparse.data.array_cache import channel_histograms, histogram_stats
from fedjax_sparse.data.dataset import Dataset, example_kind
from fedjax_sparse.data.process_layout import ProcessLayout
from fedjax_sparse.data.windows import HostData, Windows, fill_windows

FORMAT, VERSION = "fedjax_sparse.mmap", 1
MANIFEST = "manifest.json"
SPLITS = ("train", "test")
PREFIX = "mmap:"
_CHUNK_BYTES = 64 * 2 ** 20


def _digest_header(h, dtype, shape) -> None:
    h.update(f"{np.dtype(dtype).str}{tuple(int(s) for s in shape)}".encode())


def write_split(folder: str | os.PathLike, split: str, x_chunks: Iterable[np.ndarray], y: np.ndarray,
                example_shape: tuple, dtype, clients: np.ndarray | None = None) -> dict:
    """Writes one split's examples (`x_chunks`, consecutive rows adding up to len(y)), labels and clients;
    returns its manifest entry. Only one chunk is in memory at a time. The labels' values are read once the
    chunks are written, so a reader may fill `y` as it makes the chunks (`SplitSource`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    n, shape = len(y), (len(y), *example_shape)
    x = np.lib.format.open_memmap(folder / f"{split}_x.npy", mode="w+", dtype=dtype, shape=shape)
    h = hashlib.blake2b(digest_size=16)
    _digest_header(h, dtype, shape)
    filled = 0
    try:  # the map closed however the chunks end (a source that raises mid-way included)
        for chunk in x_chunks:
            chunk = np.ascontiguousarray(chunk, dtype=dtype)
            if filled + len(chunk) > n or chunk.shape[1:] != tuple(example_shape):
                raise ValueError(f"{split}: chunks of shape {chunk.shape} do not fill {shape}")
            x[filled:filled + len(chunk)] = chunk
            h.update(memoryview(chunk).cast("B"))
            filled += len(chunk)
        if filled != n:
            raise ValueError(f"{split}: the chunks gave {filled} examples for {n} labels")
        x.flush()
    finally:
        del x
    y = np.asarray(y, np.int32)
    np.save(folder / f"{split}_y.npy", y)
    _digest_header(h, y.dtype, y.shape)  # the digest of (x, y) as `run.fingerprint` takes it
    h.update(memoryview(y).cast("B"))
    if clients is not None:
        np.save(folder / f"{split}_clients.npy", np.asarray(clients))
    return {"examples": n, "shape": list(example_shape), "dtype": np.dtype(dtype).name, "digest": h.hexdigest(),
            "clients": clients is not None}


def write_manifest(folder: str | os.PathLike, *, name: str, num_classes: int, class_names, mean, std,
                   augment: bool, splits: dict, client_names=None) -> Path:
    """Writes manifest.json, last: the folder is a data set from then on."""
    manifest = {"format": FORMAT, "version": VERSION, "name": name, "num_classes": int(num_classes),
                "class_names": list(class_names), "mean": [float(m) for m in mean], "std": [float(s) for s in std],
                "augment": bool(augment), "splits": splits,
                "client_names": None if client_names is None else list(client_names)}
    path = Path(folder) / MANIFEST
    path.write_text(json.dumps(manifest))
    return path


@dataclasses.dataclass(frozen=True)
class SplitSource:
    """One split to write: `read(rows)` yields its examples (`example_shape`, `dtype`) in consecutive chunks
    of at most `rows`, each made only when asked for; `y` its labels, whose values a reader may fill as it
    reads (`write_split` reads them last); `clients` each example's client, where the source has them."""

    y: np.ndarray
    example_shape: tuple
    dtype: np.dtype
    read: Callable[[int], Iterator[np.ndarray]]
    clients: np.ndarray | None = None
    decoded_factor: int = 1  # how many times an example's bytes the reader holds while making it


@dataclasses.dataclass(frozen=True)
class ChunkedSource:
    """A data set to write split by split (`write_source`): what a `Dataset` holds, with each split's
    examples read in chunks. `mean`/`std` None: computed from the training images as they are written."""

    name: str
    num_classes: int
    class_names: tuple
    augment: bool
    train: SplitSource
    test: SplitSource
    mean: tuple | None = None
    std: tuple | None = None
    client_names: tuple | None = None


WRITING = ".fedjax_sparse_converting"  # in a folder while `write_source` writes it: the files there are its own


def _written_files(split: str) -> tuple[str, ...]:
    return tuple(f"{split}_{part}.npy" for part in ("x", "y", "clients"))


def refuse_written(folder: Path) -> None:
    """Refuses a folder holding anything a conversion did not write (the user's files, which it would
    overwrite or mix with its own), or a finished data set; an empty or new folder, or one a conversion cut
    short left (its mark and its files), is written."""
    if (folder / MANIFEST).exists():
        raise ValueError(f"{folder} already holds a data set ({MANIFEST}); choose an empty folder")
    try:
        present = sorted(p.name for p in folder.iterdir())
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise ValueError(f"{folder} is a file, not a folder; choose an empty or new folder") from None
    ours = {WRITING, *(name for split in SPLITS for name in _written_files(split))}
    foreign = [name for name in present if name not in ours or WRITING not in present]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{folder} is not empty ({shown}) and fedjax-sparse convert did not write it: a conversion "
                         f"would overwrite or mix with those files; choose an empty or new folder")


def _in_memory(x: np.ndarray, y: np.ndarray, clients: np.ndarray | None) -> SplitSource:
    return SplitSource(y=y, example_shape=x.shape[1:], dtype=x.dtype, clients=clients,
                       read=lambda rows: (x[start:start + rows] for start in range(0, len(x), rows)))


def write_source(source: ChunkedSource, folder: str | os.PathLike) -> Path:
    """Writes `source` as a memory-mapped folder (module docstring), `_CHUNK_BYTES` of examples a chunk;
    returns the folder."""
    folder = Path(folder)
    refuse_written(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WRITING).touch()  # before any file of its own: a conversion cut short may be run again
    splits, histograms = {}, None
    for split in SPLITS:
        part = getattr(source, split)
        row_bytes = int(np.prod(part.example_shape, dtype=np.int64)) * np.dtype(part.dtype).itemsize
        read = part.read(max(1, _CHUNK_BYTES // max(1, row_bytes * part.decoded_factor)))
        with contextlib.closing(read):  # a write that fails closes the reader (an image folder's worker pool)
            chunks = read
            if split == "train" and source.mean is None:
                histograms = np.zeros((part.example_shape[-1], 256), np.int64)
                chunks = _counted(chunks, histograms)
            splits[split] = write_split(folder, split, chunks, part.y, part.example_shape, part.dtype, part.clients)
        if len(part.y) and (np.min(part.y) < 0 or np.max(part.y) >= source.num_classes):  # as `Dataset` refuses
            raise ValueError(f"{source.name}: y_{split} labels outside [0, {source.num_classes})")
    mean, std = (source.mean, source.std) if histograms is None else histogram_stats(histograms)
    write_manifest(folder, name=source.name, num_classes=source.num_classes, class_names=source.class_names,
                   mean=mean, std=std, augment=source.augment, splits=splits, client_names=source.client_names)
    (folder / WRITING).unlink()
    return folder


def _counted(chunks: Iterable[np.ndarray], histograms: np.ndarray) -> Iterator[np.ndarray]:
    """`chunks`, their pixel histograms added to `histograms` as they pass."""
    for chunk in chunks:
        histograms += channel_histograms(chunk)
        yield chunk


def save_mapped(dataset: Dataset, folder: str | os.PathLike) -> Path:
    """Writes `dataset` as a memory-mapped folder (module docstring); returns the folder."""
    splits = {split: _in_memory(getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}"),
                                getattr(dataset, f"{split}_clients")) for split in SPLITS}
    return write_source(ChunkedSource(name=dataset.name, num_classes=dataset.num_classes,
                                      class_names=dataset.class_names, augment=dataset.augment, mean=dataset.mean,
                                      std=dataset.std, client_names=dataset.client_names, **splits), folder)


def read_manifest(folder: str | os.PathLike) -> dict:
    """The folder's manifest, checked; a one-line ValueError saying what is wrong otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"mmap:{folder}: no such folder; write one with `fedjax-sparse convert SPEC {folder}`")
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"mmap:{folder}: no {MANIFEST} (not a converted data set, or its conversion did not "
                         f"finish); write it with `fedjax-sparse convert SPEC {folder}`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"mmap:{folder}: {MANIFEST} is not JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"mmap:{folder}: {MANIFEST} is not a {FORMAT} version {VERSION} manifest")
    missing = [key for key in ("name", "num_classes", "class_names", "mean", "std", "augment", "splits")
               if key not in manifest] + [f"splits.{s}" for s in SPLITS if s not in manifest.get("splits", {})]
    if missing:
        raise ValueError(f"mmap:{folder}: {MANIFEST} lacks {', '.join(missing)}")
    return manifest


def has_clients(folder: str | os.PathLike) -> bool:
    """Whether the folder's data set has its own clients (False where it cannot be read: loading says why)."""
    try:
        return bool(read_manifest(folder)["splits"]["train"].get("clients"))
    except ValueError:
        return False


def _open_examples(path: Path, entry: dict) -> np.ndarray:
    """The split's examples, memory-mapped, checked against the manifest's entry."""
    try:
        x = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot be mapped ({' '.join(str(err).split())})") from None
    expected = (int(entry["examples"]), *entry["shape"])
    if x.shape != expected or x.dtype != np.dtype(entry["dtype"]):
        raise ValueError(f"{path} holds {x.dtype} {x.shape}, the manifest says {entry['dtype']} {expected}")
    return x


def _open_small(path: Path, n: int, what: str) -> np.ndarray:
    try:
        a = np.load(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot be read ({' '.join(str(err).split())})") from None
    if a.shape != (n,):
        raise ValueError(f"{path} holds {a.shape} {what}, the manifest says ({n},)")
    return a


@dataclasses.dataclass(frozen=True)
class MappedDataset(Dataset):
    """A `Dataset` whose examples are memory-mapped from `folder` (labels and clients in memory);
    `digests`: each split's content digest, as `run.fingerprint` takes it."""

    folder: str = ""
    digests: dict = dataclasses.field(default_factory=dict)

    def subset(self, max_train: int | None, max_test: int | None, seed: int) -> Dataset:
        if max_train is None and max_test is None:
            return self
        # a subset is held in memory, as any data set's: a plain Dataset of the picked rows
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(Dataset)}
        return Dataset(**plain).subset(max_train, max_test, seed)

    def on_host(self, train_indices, test_indices, process: ProcessLayout) -> tuple[HostData, HostData]:
        """This process's clients' `MappedHostData`, training and local test (`data.clients.Federation`)."""
        return (mapped_host_data(self, "train", train_indices, process),
                mapped_host_data(self, "test", test_indices, process))


def open_mapped(folder: str | os.PathLike) -> MappedDataset:
    """The data set of a converted folder, its examples memory-mapped; one-line ValueErrors for a bad folder."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    arrays, digests = {}, {}
    for split in SPLITS:
        entry = manifest["splits"][split]
        arrays[f"x_{split}"] = _open_examples(folder / f"{split}_x.npy", entry)
        arrays[f"y_{split}"] = _open_small(folder / f"{split}_y.npy", int(entry["examples"]), "labels")
        if entry.get("clients"):
            arrays[f"{split}_clients"] = _open_small(folder / f"{split}_clients.npy", int(entry["examples"]),
                                                     "clients")
        digests[split] = entry["digest"]
    names = manifest.get("client_names")
    try:
        return MappedDataset(name=manifest["name"], num_classes=int(manifest["num_classes"]),
                             class_names=tuple(manifest["class_names"]), mean=tuple(manifest["mean"]),
                             std=tuple(manifest["std"]), augment=bool(manifest["augment"]),
                             client_names=None if names is None else tuple(names), folder=str(folder),
                             digests=digests, **arrays)
    except ValueError as err:
        raise ValueError(f"mmap:{folder}: {err}") from None


@dataclasses.dataclass(frozen=True)
class MappedHostData(HostData):
    """`HostData` of this process's clients whose examples stay in the split's .npy file: client `local`'s
    examples are rows `rows[offsets[local]:offsets[local] + counts[local]]` of the file at `path` (`x`: its
    map, for the shape, dtype and data offset), read when `windows` asks for them (labels `y`, like
    `offsets`, by local client, in memory)."""

    rows: np.ndarray = None
    path: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of examples this process reads from disk (its clients'), labels held."""
        return int(len(self.rows) * self.x[:1].nbytes + self.y.nbytes)

    def windows(self, ids: np.ndarray) -> Windows:
        """The windows of the sampled `ids` this process owns (zeros elsewhere), read from the file (module
        docstring): one positioned read for each run of consecutive rows."""
        process = ProcessLayout(self.process_index, self.process_count)
        shape, dtype = self.x.shape[1:], self.x.dtype
        row_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)

        def examples(client):
            local = client // self.process_count
            start, n = int(self.offsets[local]), int(self.counts[local])
            rows = self.rows[start:start + n]
            runs = np.concatenate([[0], np.flatnonzero(np.diff(rows) != 1) + 1, [n]])
            parts = [os.pread(fd, int(b - a) * row_bytes, self.x.offset + int(rows[a]) * row_bytes)
                     for a, b in zip(runs[:-1], runs[1:])]
            return np.frombuffer(b"".join(parts), dtype).reshape(n, *shape), self.y[start:start + n]

        try:
            return fill_windows(ids, self.max_count, shape, dtype, process, examples)
        finally:
            os.close(fd)


def mapped_host_data(dataset: MappedDataset, split: str, client_indices, process: ProcessLayout | None = None
                     ) -> MappedHostData:
    """The clients of `client_indices` (rows of `split`) that `process` owns, laid out as
    `windows.host_data` lays them out, with their rows read from the map when a round samples them."""
    x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
    example_kind(x)
    process = process or ProcessLayout()
    sizes = np.array([len(ix) for ix in client_indices], np.int64)
    if len(sizes) == 0 or sizes.min() < 1:
        raise ValueError("every client needs at least one example")
    own = [np.asarray(client_indices[i], np.int64) for i in range(process.index, len(client_indices), process.count)]
    counts = sizes[process.index::process.count].astype(np.int32)
    rows = np.concatenate(own) if own else np.zeros(0, np.int64)
    return MappedHostData(x=x, y=np.asarray(y[rows], np.int32),
                          offsets=np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64), counts=counts,
                          mean=np.asarray(dataset.mean, np.float32), std=np.asarray(dataset.std, np.float32),
                          max_count=int(sizes.max()), num_clients=len(client_indices),
                          augment=dataset.augment if split == "train" else False,
                          process_index=process.index, process_count=process.count, rows=rows,
                          path=str(Path(dataset.folder) / f"{split}_x.npy"))
