#!/bin/sh
# tritonserver on the exported repository, with Python-backend shared memory sized for logits and
# hidden states (the backend's 1 MiB default is outgrown), and one MKL thread unless MKL_NUM_THREADS is set
# (CPU steps on the engine's thread: bench/cpu_threads.py). Extra arguments go to tritonserver.
set -eu
MODEL_REPOSITORY=${MODEL_REPOSITORY:-/repository}
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"

if [ ! -f "$MODEL_REPOSITORY/spec_decode/config.pbtxt" ]; then
    echo "serve: MODEL_REPOSITORY=$MODEL_REPOSITORY has no spec_decode/config.pbtxt (run the export first)" >&2
    exit 1
fi
exec tritonserver \
    --model-repository="$MODEL_REPOSITORY" \
    --model-control-mode=none \
    --http-port=8000 --grpc-port=8001 --metrics-port=8002 \
    --backend-config=python,shm-default-byte-size=16777216 \
    --backend-config=python,shm-growth-byte-size=16777216 \
    --log-verbose="${TRITON_LOG_VERBOSE:-0}" \
    "$@"
