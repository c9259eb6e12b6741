"""`fedjax-sparse convert SPEC FOLDER`: writes a `--dataset` spec as a memory-mapped folder, which a run
then reads with `--dataset mmap:FOLDER` (`data.mapped`); an image folder or a TFDS data set is streamed,
64 MiB of examples at a time, so it may be larger than memory."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fedjax_sparse.data.mapped import convert


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
