#!/usr/bin/env bash
# Submit `preprocess build-shards` to a running Ray cluster as a Ray job.
#
#   RAY_JOB_SERVER=http://HEAD:8265 \
#   INPUT=/shared/datasets/imagenet/train OUTPUT=/shared/shards/imagenet-224 \
#   bash docs/examples/build_shards_ray_job.sh [extra build-shards flags...]
#
# Run it from anywhere inside the repository checkout. It uploads the checkout
# as the job's working directory (what .gitignore names, such as .venv, stays
# behind), so every node runs this exact version of `preprocess` and `shards`;
# the nodes only need the dependencies (see ray-cluster.yaml, setup_commands).
#
# The job's driver runs on the head node and reserves no CPU: it lists the
# inputs, plans the shards, keeps at most 2 tasks per cluster CPU in flight and
# writes the manifest. Each shard is one task of 1 CPU on any node.
#
# INPUT and OUTPUT must be the same path on every node (NFS, Lustre, a mounted
# bucket) or an object-store URL (OUTPUT=s3://bucket/prefix, credentials from
# each node's environment or instance role; see docs/DISTRIBUTED.md, Object store).
#
# Faults: a lost worker node costs the shards it was building, which Ray
# reruns elsewhere (max_retries=3) once the node is declared dead. A lost
# driver (the head node lost, `ray job stop`) costs the
# shards in flight: submit the same command again and it reuses every finished
# shard after checking its checksums ("shards built X, reused Y").
set -euo pipefail

: "${RAY_JOB_SERVER:=http://127.0.0.1:8265}"  # the head's dashboard port (job server)
: "${INPUT:?set INPUT to an ImageFolder root or a CSV/JSONL/Parquet manifest}"
: "${OUTPUT:?set OUTPUT to a shared directory or an s3:// URL}"
# Sizing: at least 4 shards per cluster CPU keeps every CPU busy to the end of
# the build, and the train split needs at least nodes x GPUs x loader workers
# shards for training (see docs/DISTRIBUTED.md, Sizing shards).
: "${SHARD_SIZE:=1000}"
: "${IMAGE_SIZE:=256}"
# Unique per submission; reuse the OUTPUT, not the id, to resume.
: "${SUBMISSION_ID:=build-shards-$(date +%Y%m%d-%H%M%S)}"

cd "$(git rev-parse --show-toplevel)"

# `--ray-address auto`: inside a job Ray sets RAY_ADDRESS to the cluster, and
# `auto` takes it. `--no-progress`: the job log is not a terminal.
# Add `--no-wait` to return at once, then `ray job logs -f "$SUBMISSION_ID"`.
exec ray job submit \
    --address "$RAY_JOB_SERVER" \
    --submission-id "$SUBMISSION_ID" \
    --working-dir . \
    --runtime-env-json '{"excludes": [".git", "tests", "benchmarks"]}' \
    -- python -m preprocess.cli build-shards \
        --input "$INPUT" \
        --output "$OUTPUT" \
        --shard-size "$SHARD_SIZE" \
        --image-size "$IMAGE_SIZE" \
        --val-fraction 0.01 \
        --ray-address auto \
        --no-progress \
        "$@"
