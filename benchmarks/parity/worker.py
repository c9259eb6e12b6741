"""The PyTorch side's entry point, run by the driver in the torch environment (never imports JAX):

    python -m benchmarks.parity.worker setup METHOD --checkout DIR --workdir DIR --seed SEED
    python -m benchmarks.parity.worker official METHOD --checkout DIR --workdir DIR --seed SEED --case CASE [--floor]

`setup` writes WORKDIR/setup.npz and WORKDIR/torch.json (versions); `official` reads setup.npz and
library.npz and writes WORKDIR/official_<case>.npz, or with --floor official_<case>_floor.npz: the
same run with one ulp of noise in every parameter after every optimizer step
(`torch_side.round_off_noise`). One process per phase and case: their modules
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
    parser.add_argument("--floor", action="store_true", help="the run under round-off noise (the floor)")
    parser.add_argument("--seed", type=int, required=True, help="the draw of the inputs (the driver redraws "
                                                                  "inputs near a tie)")
    args = parser.parse_args(argv)
    method = get(args.method)
    workdir = args.workdir.resolve()
    checkout = args.checkout.resolve()
    if args.phase == "setup":
        A.save(workdir / "setup.npz", method.torch_setup(checkout, args.seed))
        import numpy
        import torch
        (workdir / "torch.json").write_text(json.dumps({"torch": torch.__version__, "numpy": numpy.__version__,
                                                        "python": platform.python_version()}))
        return 0
    if args.case not in method.CASES:
        parser.error(f"--case must be one of {', '.join(method.CASES)}, got {args.case!r}")
    setup = A.load(workdir / "setup.npz")
    library = A.load(workdir / "library.npz")
    if args.floor:
        from benchmarks.parity import torch_side
        torch_side.round_off_noise(args.seed)
    A.save(workdir / f"official_{args.case}{'_floor' if args.floor else ''}.npz",
           method.torch_official(checkout, setup, library, args.case))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
