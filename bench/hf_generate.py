"""transformers' `DeepseekV3ForCausalLM.generate(do_sample=False)` on the same checkpoint and prompts, batch 1.

The reference point for P5 (triton-mtp plain decoding / transformers generate). transformers ignores
the MTP layers (`model.layers.{N}.*`). Stops at max_tokens or EOS, like the server.

    python -m bench.hf_generate --checkpoint DIR --out hf_generate.json [--device cuda --dtype bf16]
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import DeepseekV3ForCausalLM
from transformers.utils import logging as hf_logging

from .common import environment, held_out_prompts, synchronize, write_result
from triton_mtp.export.checkpoint import resolve_dtype


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    hf_logging.set_verbosity_error()  # the unused MTP tensors are expected
    model = DeepseekV3ForCausalLM.from_pretrained(args.checkpoint, dtype=resolve_dtype(args.dtype)).to(device).eval()
    prompts = held_out_prompts(args.checkpoint, args.prompts, args.prompt_tokens)
    eos = model.config.eos_token_id

    def generate(prompt: list[int], max_tokens: int) -> tuple[int, float]:
        ids = torch.tensor([prompt], device=device)  # [1, P]
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=eos)  # [1, P + n]
        synchronize(device)
        new = out[0, len(prompt):].tolist()
        if eos in new:
            new = new[: new.index(eos)]
        return len(new), time.perf_counter() - start

    generate(prompts[0], 4)  # warm-up
    timings = [generate(p, args.max_tokens) for p in prompts]
    tokens, seconds = sum(t for t, _ in timings), sum(s for _, s in timings)
    result = {"benchmark": "hf_generate", "dtype": args.dtype, "device": str(device), "prompts": len(prompts),
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "environment": environment(),
              "output_tokens": tokens, "tokens_per_s": tokens / seconds if seconds else 0.0}
    print(f"transformers generate: {result['tokens_per_s']:.1f} tokens/s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    write_result(args.out, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
