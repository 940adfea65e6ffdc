set -e
cd /work/main
for n in 1 4; do
  python -m triton_mtp.cli export --checkpoint models/tiny-dsv3-mtp --repository /tmp/si/repo$n --device cpu \
      --max-slots 16 --max-seq-len 200 --max-draft-tokens 2 --hops local --stream-interval $n > /tmp/si/export$n.log 2>&1
done
for pair in 1 2; do
  for n in 1 4; do
    python -m bench.triton_bench --checkpoint models/tiny-dsv3-mtp --repository /tmp/si/repo$n --prompts 4 \
        --prompt-tokens 32 --max-tokens 48 --draft-tokens 0,2 --concurrency 16 --warmup 1 --out /tmp/si/tb$n-$pair.json > /tmp/si/tb$n-$pair.log 2>&1
  done
done
echo done
