#!/usr/bin/env bash
# The training run of the bundled model on the GPU host (project not installed there).
# Usage, from the repository root: OUT=<results dir> bash bench/gpu_train.sh [extra `triton-mtp train` flags]
# Writes $OUT/tiny-dsv3-mtp/ (checkpoint, tokenizer, train_log.jsonl, train.json, loss_curve.png when
# matplotlib is present) and $OUT/train_stdout.log.
set -euo pipefail
repo=$(pwd)
shim=$(mktemp -d)
mkdir "$shim/triton_mtp"
for f in "$repo"/triton_mtp/*.py; do ln -s "$f" "$shim/triton_mtp/"; done
for pkg in export serving client train model_repository; do ln -s "$repo/$pkg" "$shim/triton_mtp/$pkg"; done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"  # -P below: the checkout root must not shadow the shim
python - <<'PY'
import sys, torch, transformers, tokenizers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "cuda", torch.cuda.is_available(), flush=True)
PY
python -P -m triton_mtp.cli train --out "$OUT/tiny-dsv3-mtp" --device cuda \
    --time-budget 360 "$@" 2>&1 | tee "$OUT/train_stdout.log"
