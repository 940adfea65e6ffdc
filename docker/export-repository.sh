#!/bin/sh
# Build the Triton model repository from a checkpoint directory (one-shot: the compose `export`
# service, the Kubernetes init container). Settings come from the environment; an unset one leaves
# `triton-mtp export`'s default in place.
set -eu
CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoint}
MODEL_REPOSITORY=${MODEL_REPOSITORY:-/repository}

if [ ! -f "$CHECKPOINT_DIR/config.json" ]; then
    echo "export-repository: CHECKPOINT_DIR=$CHECKPOINT_DIR has no config.json (mount a Hugging Face checkpoint there)" >&2
    exit 1
fi

set -- --checkpoint "$CHECKPOINT_DIR" --repository "$MODEL_REPOSITORY"
[ -n "${EXPORT_FORMAT:-}" ] && set -- "$@" --format "$EXPORT_FORMAT"
[ -n "${EXPORT_DEVICE:-}" ] && set -- "$@" --device "$EXPORT_DEVICE"
[ -n "${EXPORT_DTYPE:-}" ] && set -- "$@" --dtype "$EXPORT_DTYPE"
[ -n "${MAX_SLOTS:-}" ] && set -- "$@" --max-slots "$MAX_SLOTS"
[ -n "${MAX_SEQ_LEN:-}" ] && set -- "$@" --max-seq-len "$MAX_SEQ_LEN"
[ -n "${MAX_DRAFT_TOKENS:-}" ] && set -- "$@" --max-draft-tokens "$MAX_DRAFT_TOKENS"
[ -n "${NUM_DRAFT_TOKENS:-}" ] && set -- "$@" --default-num-draft-tokens "$NUM_DRAFT_TOKENS"
[ -n "${MAX_QUEUE_SIZE:-}" ] && set -- "$@" --max-queue-size "$MAX_QUEUE_SIZE"
[ -n "${REQUEST_TIMEOUT_S:-}" ] && set -- "$@" --request-timeout "$REQUEST_TIMEOUT_S"
[ -n "${TENSOR_PARALLEL:-}" ] && set -- "$@" --tensor-parallel "$TENSOR_PARALLEL"
[ -n "${HOPS:-}" ] && set -- "$@" --hops "$HOPS"
[ "${CUDA_GRAPHS:-true}" = false ] && set -- "$@" --no-cuda-graphs
[ "${COMPILE_GRAPHS:-false}" = true ] && set -- "$@" --compile-graphs
[ -n "${RESPONSE_THREADS:-}" ] && set -- "$@" --response-threads "$RESPONSE_THREADS"
[ -n "${STREAM_INTERVAL:-}" ] && set -- "$@" --stream-interval "$STREAM_INTERVAL"

mkdir -p "$MODEL_REPOSITORY"
find "$MODEL_REPOSITORY" -mindepth 1 -maxdepth 1 -exec rm -rf {} +  # no stale model from an earlier export
exec triton-mtp export "$@"
