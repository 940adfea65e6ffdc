#!/bin/bash
# Host work per step (null replays) at three commits, alternating, two passes each, on the 2-core CPU host.
# 03de31a: before serving/transfers.py; 503da41: with it (0e2f1b5); new: the working tree (GraphedChain).
# Each tree is importable as triton_mtp from a folder of links (PYTHONPATH), as the editable install maps it.
set -e
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
for c in 03de31a 503da41; do
  rm -rf /tmp/ab-$c /tmp/abpkg-$c && git -C "$repo" worktree add -q -f /tmp/ab-$c $c
  mkdir -p /tmp/abpkg-$c/triton_mtp && cp /tmp/ab-$c/triton_mtp/*.py /tmp/abpkg-$c/triton_mtp/
  for d in serving export bench client model_repository train; do ln -s /tmp/ab-$c/$d /tmp/abpkg-$c/triton_mtp/$d; done
done
ckpt=$repo/models/tiny-dsv3-mtp
common="--checkpoint $ckpt --graphs --null-replays --prompts 32 --max-slots 64 --overlap --stream 4"
cd /tmp
for pass in 1 2; do
  for tree in 03de31a 503da41 new; do
    if [ $tree = new ]; then pp=; else pp=/tmp/abpkg-$tree; fi
    PYTHONPATH=$pp python "$here/ab.py" $common --thread --prompt-tokens 128 --max-tokens 128 --draft-tokens 0 \
      --out "$here/plain-contended-$tree-$pass.json" | grep ms/step | sed "s/^/$tree plain, contended: /"
    PYTHONPATH=$pp python -m triton_mtp.bench.engine_overhead $common --prompt-tokens 32 --max-tokens 300 \
      --draft-tokens 3 --out "$here/chained-k3-$tree-$pass.json" | grep ms/step | sed "s/^/$tree chained: /"
    PYTHONPATH=$pp python "$here/ab.py" $common --thread --prompt-tokens 32 --max-tokens 300 --draft-tokens 3 \
      --out "$here/chained-k3-contended-$tree-$pass.json" | grep ms/step | sed "s/^/$tree chained, contended: /"
  done
done
for tree in 03de31a 503da41 new; do
  if [ $tree = new ]; then pp=; else pp=/tmp/abpkg-$tree; fi
  for k in 0 3; do
    PYTHONPATH=$pp python "$here/count_ops.py" $common --prompt-tokens 32 --max-tokens 300 --draft-tokens $k \
      | grep dispatched | sed "s/^/$tree k=$k: /"
  done
done
for c in 03de31a 503da41; do git -C "$repo" worktree remove --force /tmp/ab-$c; rm -rf /tmp/abpkg-$c; done
