#!/usr/bin/env bash
# The training run of the bundled model on the GPU host (project not installed there), in two phases:
#   phase 1  triton-mtp train: target + MTP from scratch (next-token + λ·MTP loss) -> $OUT/phase1/
#   phase 2  triton-mtp train --distill-from: target frozen, MTP layers distilled from it -> $OUT/tiny-dsv3-mtp/
# Usage, from the repository root: OUT=<results dir> bash bench/gpu_train.sh
#   FROM=<checkpoint dir>  skips phase 1 and distills from that checkpoint (e.g. models/tiny-dsv3-mtp)
#   PHASE1_BUDGET / PHASE2_BUDGET  training seconds of each phase (360 / 170)
# Each phase writes its checkpoint, tokenizer, logs (train_log.jsonl or distill_log.jsonl), a summary json and
# a loss curve PNG when matplotlib is present; stdout goes to $OUT/train_stdout.log / $OUT/distill_stdout.log.
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
from=${FROM:-}
if [ -z "$from" ]; then
    python -P -m triton_mtp.cli train --out "$OUT/phase1" --device cuda \
        --time-budget "${PHASE1_BUDGET:-360}" 2>&1 | tee "$OUT/train_stdout.log"
    from="$OUT/phase1"
fi
python -P -m triton_mtp.cli train --distill-from "$from" --out "$OUT/tiny-dsv3-mtp" --device cuda \
    --time-budget "${PHASE2_BUDGET:-170}" 2>&1 | tee "$OUT/distill_stdout.log"
