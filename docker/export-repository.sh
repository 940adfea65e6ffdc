#!/bin/sh
# Build the Triton model repository from a checkpoint directory (one-shot; compose `export` service,
# Kubernetes init container). Settings come from the environment; defaults serve the bundled tiny model.
set -eu
CHECKPOINT_DIR=${CHECKPOINT_DIR:-/checkpoint}
MODEL_REPOSITORY=${MODEL_REPOSITORY:-/repository}

if [ ! -f "$CHECKPOINT_DIR/config.json" ]; then
    echo "export-repository: CHECKPOINT_DIR=$CHECKPOINT_DIR has no config.json (mount a Hugging Face checkpoint there)" >&2
    exit 1
fi
mkdir -p "$MODEL_REPOSITORY"
find "$MODEL_REPOSITORY" -mindepth 1 -maxdepth 1 -exec rm -rf {} +  # a stale model from an earlier export must not survive
exec triton-mtp export \
    --checkpoint "$CHECKPOINT_DIR" \
    --repository "$MODEL_REPOSITORY" \
    --format "${EXPORT_FORMAT:-torchscript}" \
    --device "${EXPORT_DEVICE:-cuda}" \
    --dtype "${EXPORT_DTYPE:-fp32}" \
    --max-slots "${MAX_SLOTS:-8}" \
    --max-seq-len "${MAX_SEQ_LEN:-1024}" \
    --max-draft-tokens "${MAX_DRAFT_TOKENS:-4}" \
    --default-num-draft-tokens "${NUM_DRAFT_TOKENS:-2}"
