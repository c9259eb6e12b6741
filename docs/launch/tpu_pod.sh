#!/bin/bash
# A TPU VM pod slice: the same command on every worker; JAX finds the others itself (--cluster).
# Its workers share no disk: the run folder is a Cloud Storage bucket, mounted with gcsfuse at the same
# path on every worker, where each process writes its part of a checkpoint.
set -euo pipefail
TPU=my-v4-32
ZONE=us-central2-b
BUCKET=my-bucket

SOURCE=./fedjax_sparse  # a checkout of this repository

# The environment, on every worker: the library with JAX for TPUs, and the bucket mounted
SETUP="python3 -m venv ~/fedjax && ~/fedjax/bin/pip install -q ~/fedjax_sparse 'jax[tpu]' \
&& sudo mkdir -p /mnt/bucket && sudo chown \$USER /mnt/bucket \
&& (mountpoint -q /mnt/bucket || gcsfuse --implicit-dirs $BUCKET /mnt/bucket)"

RUN_DIR=/mnt/bucket/runs/fedavg
RUN_FLAGS="--dataset synthetic:1,1 --algorithm fedavg --num-clients 1000000 --clients-per-round 256 \
--rounds 2000 --eval-every 10 --checkpoint-every 50 --no-progress"

# Started again once the run has a checkpoint: resume it, with the same flags
RUN="source ~/fedjax/bin/activate && if ls $RUN_DIR/checkpoints 2>/dev/null | grep -qx '[0-9][0-9]*'; \
then START='--resume $RUN_DIR'; else START='--out $RUN_DIR'; fi \
&& fedjax-sparse run --cluster \$START $RUN_FLAGS"

gcloud compute tpus tpu-vm scp --recurse "$SOURCE" "$TPU":~/fedjax_sparse --zone "$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command="$SETUP"
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command="$RUN"
