"""The PyTorch side's entry point, run by the driver in the torch environment (never imports JAX):

    python -m benchmarks.parity.worker setup METHOD --checkout DIR --workdir DIR
    python -m benchmarks.parity.worker official METHOD --checkout DIR --workdir DIR --case CASE

`setup` writes WORKDIR/setup.npz and WORKDIR/torch.json (versions); `official` reads setup.npz and
library.npz and writes WORKDIR/official_<case>.npz. One process per phase and case: their modules
(HeteroFL's and FedRolex's both named `config`, `models`, `utils`) and the harness's monkeypatches
never meet.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from benchmarks.parity import arrays as A
from benchmarks.parity.methods import get


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parity.worker")
    parser.add_argument("phase", choices=("setup", "official"))
    parser.add_argument("method")
    parser.add_argument("--checkout", type=Path, required=True, help="the official code's folder to run from")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--case", default=None)
    args = parser.parse_args(argv)
    method = get(args.method)
    workdir = args.workdir.resolve()
    checkout = args.checkout.resolve()
    if args.phase == "setup":
        A.save(workdir / "setup.npz", method.torch_setup(checkout))
        import numpy
        import torch
        (workdir / "torch.json").write_text(json.dumps({"torch": torch.__version__, "numpy": numpy.__version__,
                                                        "python": platform.python_version()}))
        return 0
    if args.case not in method.CASES:
        parser.error(f"--case must be one of {', '.join(method.CASES)}, got {args.case!r}")
    setup = A.load(workdir / "setup.npz")
    library = A.load(workdir / "library.npz")
    A.save(workdir / f"official_{args.case}.npz", method.torch_official(checkout, setup, library, args.case))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
