"""What keying the image-folder cache on file contents costs: first and second load of a folder.

    python -m benchmarks.image_cache_key [FOLDER] [--json FILE]

FOLDER defaults to $FEDJAX_SPARSE_CIFAR10, else ../shared/data/cifar10-jpeg. In one process, with
a fresh, temporary cache:

  listing      the sorted file list of both splits (what any key needs);
  content key  `image_folder._cache_key`: the list and every file's bytes, hashed (what a load adds now);
  mtime stat   one stat per file, what the earlier key read instead of the contents;
  first load   `load_image_folder` with an empty cache: listing, key, decoding, writing the cache;
  second load  the same call again: listing, key, reading the cached arrays.

The key is timed twice before the loads; the files are then in the page cache (a first read
from a cold disk costs more, see the results note). Results name the device, versions and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL

from .evaluation import default_cifar10 as cifar10_folder
from fedjax_sparse.data.image_folder import _cache_key, _list_split, load_image_folder


def _timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def measure(root: Path) -> dict:
    root = root.resolve()

    def listing():
        relative = []
        for split in ("train", "test"):
            classes, files = _list_split(root, split)
            relative += [f"{split}/{c}/{f}" for c, fs in zip(classes, files) for f in fs]
        return relative

    relative, list_seconds = _timed(listing)
    key_seconds = [_timed(lambda: _cache_key(root, relative))[1] for _ in range(2)]
    _, stat_seconds = _timed(lambda: [os.stat(root / r) for r in relative])
    megabytes = sum(os.stat(root / r).st_size for r in relative) / 1e6
    with tempfile.TemporaryDirectory(prefix="image_cache_key_") as cache:
        first, first_seconds = _timed(lambda: load_image_folder(root, cache_dir=cache, progress=False))
        second, second_seconds = _timed(lambda: load_image_folder(root, cache_dir=cache, progress=False))
    assert np.array_equal(first.x_train, second.x_train) and np.array_equal(first.x_test, second.x_test)
    return {"folder": str(root), "files": len(relative), "megabytes": round(megabytes, 1),
            "listing_seconds": list_seconds, "content_key_seconds": key_seconds,
            "mtime_stat_seconds": stat_seconds, "first_load_seconds": first_seconds,
            "second_load_seconds": second_seconds,
            "arrays_megabytes": round((first.x_train.nbytes + first.x_test.nbytes) / 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.image_cache_key", description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path(cifar10_folder()))
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args(argv)
    record = {**measure(args.folder),
              "command": "python -m benchmarks.image_cache_key " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.date.today().isoformat(),
              "device": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.processor() or 'cpu'}",
              "versions": {"python": platform.python_version(), "numpy": np.__version__, "pillow": PIL.__version__}}
    print(json.dumps(record, indent=1))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
