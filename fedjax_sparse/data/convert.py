"""`fedjax-sparse convert SPEC FOLDER`: writes a `--dataset` spec as a memory-mapped folder, which a run
then reads with `--dataset mmap:FOLDER` (`data.mapped`); an image folder or a TFDS data set is streamed,
64 MiB of examples at a time, so it may be larger than memory."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from fedjax_sparse.data.mapped import PREFIX, refuse_written, save_mapped, write_source
from fedjax_sparse.data.sources import DataError, load_dataset, stream_dataset


def convert(spec: str, folder: str | os.PathLike, *, data_dir: str | os.PathLike | None = None,
            download: bool = True, progress: bool = True, **load_options) -> Path:
    """Writes the `--dataset` `spec` to `folder` for `--dataset mmap:FOLDER`: streamed where its loader reads
    it in chunks (`data.sources.stream_dataset`), else loaded whole by `data.sources.load_dataset`
    (`load_options`, e.g. digits' `seed` or LEAF's `cache_dir`, go to it) and written (module docstring).
    `data_dir` and `download`: where a TFDS data set is and whether to prepare it; `progress`: bars."""
    if spec.startswith(PREFIX) or spec.startswith("synthetic:"):
        raise ValueError(f"cannot convert {spec!r}: it is read without loading it whole already; convert "
                         f"imagefolder:PATH, leaf:PATH, femnist, shakespeare, digits or a TFDS name")
    refuse_written(Path(folder))  # before a TFDS set is prepared or an image folder's headers are read
    options = dict(data_dir=data_dir, download=download, progress=progress)
    source = stream_dataset(spec, **options)
    if source is None:
        return save_mapped(load_dataset(spec, **options, **load_options), folder)
    try:
        return write_source(source, folder)
    except (ValueError, OSError, RuntimeError) as err:  # a bad image met while decoding: one line, as loading says
        raise DataError(f"cannot convert data set {spec!r}: {' '.join(str(err).split())}") from err


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedjax-sparse convert",
        description="Write a data set as memory-mapped .npy files for --dataset mmap:FOLDER (training then reads "
                    "only the sampled clients' examples from disk).")
    parser.add_argument("spec", help="the data set, as --dataset names it: imagefolder:PATH, leaf:PATH, femnist, "
                                     "shakespeare, cifar10, cifar100, fashion_mnist, emnist, mnist or digits")
    parser.add_argument("folder", help="an empty or new folder to write")
    parser.add_argument("--data-dir", default=None, help="the TFDS / Hugging Face data directory (as for run)")
    parser.add_argument("--no-download", action="store_true", help="read prepared data only, as for run")
    args = parser.parse_args(argv)
    try:
        folder = convert(args.spec, args.folder, data_dir=args.data_dir, download=not args.no_download,
                         progress=sys.stderr.isatty())
    except ValueError as err:  # DataError included: one line, no trace
        print(f"fedjax-sparse convert: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"wrote {folder}; train with --dataset mmap:{folder}")
    return 0
