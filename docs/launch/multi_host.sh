#!/bin/bash
# Machines without a scheduler: run this on each of them, with its process id, 0 on the coordinator's:
#   bash multi_host.sh 0    (on gpu-node-0)
#   bash multi_host.sh 1    (on gpu-node-1)
# Each process uses every GPU of its machine; every machine must hold the same number.
set -euo pipefail
PROCESS_ID=${1:?give the process id of this machine, 0 to NUM_PROCESSES - 1}
COORDINATOR=gpu-node-0:12355  # process 0's machine, and a port free there that the others reach
NUM_PROCESSES=2

# The environment, made once on a file system every machine reaches under the same path (or on each):
#   python3 -m venv /shared/venvs/fedjax && /shared/venvs/fedjax/bin/pip install ./fedjax_sparse "jax[cuda12]"
source /shared/venvs/fedjax/bin/activate

RUN_DIR=/shared/runs/scaffold  # on a file system every machine reaches under this path (NFS)
RUN_FLAGS=(--dataset synthetic:1,1 --algorithm scaffold --num-clients 100000 --clients-per-round 128
           --client-store disk --rounds 2000 --eval-every 10 --checkpoint-every 50 --no-progress)

# Started again once the run has a checkpoint: resume it, with the same flags
if ls "$RUN_DIR/checkpoints" 2>/dev/null | grep -qx '[0-9][0-9]*'; then
    START=(--resume "$RUN_DIR")
else
    START=(--out "$RUN_DIR")
fi
exec fedjax-sparse run --coordinator "$COORDINATOR" --num-processes "$NUM_PROCESSES" --process-id "$PROCESS_ID" \
    "${START[@]}" "${RUN_FLAGS[@]}"
