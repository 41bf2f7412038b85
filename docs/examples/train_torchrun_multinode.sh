#!/usr/bin/env bash
# Train on several nodes with torchrun, from shards behind an http(s) or s3 URL.
# Run this same script on every node, with the same settings:
#
#   NNODES=2 MASTER_ADDR=10.0.0.1 RUN_ID=resnet-0412 \
#   TRAIN_SHARDS=s3://bucket/datasets/v1/manifest.json RUN_DIR=/shared/runs/resnet-0412 \
#   bash docs/examples/train_torchrun_multinode.sh [extra train flags...]
#
# Under Slurm use train_slurm.sbatch instead (it derives all of this from SLURM_*).
#
# What runs where: one torchrun agent per node; it meets the other agents at the
# c10d rendezvous on MASTER_ADDR:MASTER_PORT (hosted by the agent on that node),
# then starts NPROC_PER_NODE trainer processes (one per GPU), each with WORKERS
# loader processes that stream their share of the shards. Ranks are assigned in
# order of arrival; NODE_RANK is not needed with c10d.
#
# The run directory must be on a filesystem every node sees: rank 0 writes the
# checkpoints there, and on a restart every rank reads the latest one.
#
# Faults: when a rank dies, its peers fail at their next collective (at once if
# its sockets close; after DIST_TIMEOUT_S if its node went silent), and torchrun
# restarts every worker of the job, up to MAX_RESTARTS times; `--resume auto`
# makes each restart continue from the last checkpoint, with the same samples in
# the same order as a run without the fault. When the restarts are used up, run
# this script again on every node: it continues the same way.
set -euo pipefail

: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR to an address of the rendezvous node that all nodes reach}"
: "${MASTER_PORT:=29500}"
# The same on every node, and new for each job (a stale rendezvous of the same
# id on the same port would be joined instead).
: "${RUN_ID:?set RUN_ID to a name for this job, the same on every node}"
: "${TRAIN_SHARDS:?set TRAIN_SHARDS to a manifest.json URL (s3://, https://) or a shared path}"
: "${RUN_DIR:?set RUN_DIR to a directory on a filesystem shared by all nodes}"
: "${DEVICE:=cuda}"
: "${NPROC_PER_NODE:=gpu}"  # one trainer per GPU; with DEVICE=cpu give a number
: "${WORKERS:=8}"           # loader processes per trainer
: "${MODEL:=resnet-small}"
: "${IMAGE_SIZE:=224}"
: "${BATCH_SIZE:=128}"      # per GPU: effective batch = BATCH_SIZE x GPUs x nodes
: "${EPOCHS:=90}"
: "${MAX_RESTARTS:=3}"
: "${DIST_TIMEOUT_S:=900}"  # a collective slower than this ends the job instead of hanging it
: "${LOCAL_ADDR:=}"         # this node's address for the others, if its hostname does not resolve to it

# Sizing: the train split should have at least NNODES x GPUs x WORKERS shards
# (here 2 x 8 x 8 = 128), so every loader process reads whole shards of its own.
# Fewer shards still train correctly (the loader splits at sample granularity);
# see docs/DISTRIBUTED.md, "torchrun and Slurm".

# s3:// shards use the standard AWS settings of each node: AWS_ACCESS_KEY_ID and
# AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role), AWS_DEFAULT_REGION,
# and AWS_ENDPOINT_URL_S3 for a store other than AWS (MinIO, Ceph, R2).

# Restarted workers must not find the previous round's addresses in torchrun's
# shared store (pytorch/pytorch#135712, #167288: "Connection refused" or a hang
# after a restart); a store per round avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# On nodes with several network interfaces, name the one the ranks talk over:
# export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0

cd "$(dirname "$0")/../.."  # the checkout, so that `-m trainers.train` imports it

local_addr=()
if [[ -n "$LOCAL_ADDR" ]]; then
    local_addr=(--local-addr "$LOCAL_ADDR")
fi

exec torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RUN_ID" \
    ${local_addr[@]+"${local_addr[@]}"} \
    --max-restarts "$MAX_RESTARTS" \
    -m trainers.train \
    --train-shards "$TRAIN_SHARDS" \
    --device "$DEVICE" \
    --workers "$WORKERS" \
    --model "$MODEL" \
    --image-size "$IMAGE_SIZE" \
    --batch-size "$BATCH_SIZE" \
    --epochs "$EPOCHS" \
    --run-dir "$RUN_DIR" \
    --resume auto \
    --dist-timeout-s "$DIST_TIMEOUT_S" \
    --checkpoint-every 1000 \
    --no-progress \
    "$@"
