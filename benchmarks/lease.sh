#!/usr/bin/env bash
# The accelerator lease on a machine that cannot reach a package registry (docs/benchmarks.md): the wheels in
# .whl/ (what the machine lacks) and the library itself, neither fetching anything, then benchmarks.lease.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-benchmarks/results/lease}
python3 -m benchmarks.lease --out "$out" --cifar10 .lease/cifar10-jpeg.tar.gz "$@"
