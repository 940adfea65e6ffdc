"""Detokenization cost of one streamed sequence: the engine's text stream (tokenizers' DecodeStream,
a few tokens of context per step, one whole decode for the final response) against decoding the
whole output at every step. Outputs are held-out code of the bundled model's tokenizer; a step
emits `tokens_per_step` tokens (1: plain decoding; about 2.7 with the bundled MTP at k = 3).

    python -m bench.detokenize --out bench/results/cpu-detokenize.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import environment, held_out_prompts, write_result
from triton_mtp.serving.requests import TokenizerFile

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "models" / "tiny-dsv3-mtp"


def whole_decodes(tokenizer: TokenizerFile, ids: list[int], tokens_per_step: int) -> float:
    """Seconds to decode the whole output after every step."""
    start = time.perf_counter()
    for end in range(tokens_per_step, len(ids) + tokens_per_step, tokens_per_step):
        tokenizer.decode(ids[:end])
    return time.perf_counter() - start


def text_stream(tokenizer: TokenizerFile, ids: list[int]) -> float:
    """Seconds to detokenize token by token, then decode the whole output once."""
    start = time.perf_counter()
    stream = tokenizer.decode_stream()
    text = "".join(stream.step(t) for t in ids)
    final = tokenizer.decode(ids)
    elapsed = time.perf_counter() - start
    assert final.startswith(text), "the streamed text is not a prefix of the decoded output"
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--sequences", type=int, default=4, help="outputs per length (the mean is reported)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = TokenizerFile(CHECKPOINT / "tokenizer.json")
    rows = []
    for length in args.lengths:
        outputs = held_out_prompts(CHECKPOINT, args.sequences, length)
        whole = sum(whole_decodes(tokenizer, ids, args.tokens_per_step) for ids in outputs) / len(outputs)
        stream = sum(text_stream(tokenizer, ids) for ids in outputs) / len(outputs)
        steps = -(-length // args.tokens_per_step)
        rows.append({"output_tokens": length, "steps": steps, "whole_decode_ms": whole * 1e3,
                     "text_stream_ms": stream * 1e3, "whole_decode_us_per_step": whole / steps * 1e6,
                     "text_stream_us_per_step": stream / steps * 1e6, "ratio": whole / stream})
        print(f"{length:5d} tokens: whole-output decodes {whole * 1e3:8.1f} ms ({whole / steps * 1e6:6.1f} us/step), "
              f"text stream {stream * 1e3:6.1f} ms ({stream / steps * 1e6:5.1f} us/step): {whole / stream:.1f}x")
    write_result(args.out, {"tokens_per_step": args.tokens_per_step, "rows": rows, "environment": environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
