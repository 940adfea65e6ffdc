"""Device time of the decode kernels against what they replace, per shape and kernel configuration (bf16, CUDA
graphs of back-to-back calls, so no host time is counted):

- linear: export/linear.py's kernel against F.linear (cuBLAS) for each linear shape of the DeepSeek-V2-Lite-shaped
  step (bench/realistic.py) and of the bundled model, and the routers' float32 shapes, one token (the calls the
  kernel takes), over BLOCK_N x BLOCK_K x num_warps;
- attention: export/latent_attention.py's op against its eager ops compiled as the served steps compile them
  (`attend` over the gathered rows), V2-Lite's heads and ranks at `--context` positions, 1 and 4 tokens, over
  CHUNK x BLOCK_S x num_warps, with each configuration's largest difference from the compiled ops.

    python -m bench.decode_kernels --out decode_kernels.json
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from triton_mtp.export import fused_moe, latent_attention, linear
from triton_mtp.export.formats.eager import COMPILE_OPTIONS
from triton_mtp.serving.graphs import CapturedStep

from .common import environment, write_result
from .graph_time import replay_ms

# (name, N, K[, dtype]): V2-Lite's projections (q_proj and kv_a fused as the GPU build loads them), dense MLP, head
# and router (float32); the bundled model's; DeepSeek-V3's router.
LINEAR_SHAPES = [("v2-lite q_proj", 3072, 2048), ("v2-lite kv_a", 576, 2048), ("v2-lite q_proj+kv_a", 3648, 2048),
                 ("v2-lite o_proj", 2048, 2048), ("v2-lite dense gate/up", 10944, 2048),
                 ("v2-lite dense down", 2048, 10944), ("v2-lite lm_head", 102400, 2048),
                 ("v2-lite router", 64, 2048, torch.float32), ("bundled q_b", 192, 128), ("bundled kv_a", 80, 256),
                 ("bundled q_a+kv_a", 208, 256), ("bundled lm_head", 8192, 256),
                 ("bundled router", 8, 256, torch.float32), ("v3 router", 256, 7168, torch.float32)]
LINEAR_CONFIGS = list(itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8)))  # BLOCK_N, BLOCK_K, num_warps
ATTENTION_CONFIGS = list(itertools.product((32, 64, 128), (16, 32, 64), (4, 8)))  # CHUNK, BLOCK_S, num_warps


def graph_us(call, x: torch.Tensor, calls: int = 20, replays: int = 20) -> float:
    """µs a call of `call(x)`: `calls` of them captured in one CUDA graph, whose replays are timed back to back."""
    graph = CapturedStep(lambda x: tuple(call(x) for _ in range(calls)), [x])
    return replay_ms(graph.replay, replays) * 1e3 / calls


def bench_linear(device: torch.device) -> list[dict]:
    rows = []
    for name, N, K, *dtype in LINEAR_SHAPES:
        dtype = dtype[0] if dtype else torch.bfloat16
        x = torch.randn(1, K, dtype=dtype, device=device)  # [1, K]
        weight = torch.randn(N, K, dtype=dtype, device=device) * 0.02  # [N, K]
        row = {"shape": name, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch."),
               "cublas_us": graph_us(lambda x: F.linear(x, weight), x)}
        expected = F.linear(x, weight).float()
        kernel = {}
        for block_n, block_k, warps in LINEAR_CONFIGS:
            linear.BLOCK_N, linear.BLOCK_K, linear.NUM_WARPS = block_n, block_k, warps
            error = (linear.decode_linear(x, weight).float() - expected).abs().max().item()
            kernel[f"{block_n}x{block_k}/{warps}"] = {"us": graph_us(lambda x: linear.decode_linear(x, weight), x),
                                                     "max_abs_error": error}
        best = min(kernel, key=lambda c: kernel[c]["us"])
        row.update(kernel=kernel, best=best, best_us=kernel[best]["us"])
        print(f"linear {name}: cuBLAS {row['cublas_us']:.2f} µs, kernel best {best} {row['best_us']:.2f} µs",
              flush=True)
        rows.append(row)
    return rows


def bench_attention(device: torch.device, context: int) -> list[dict]:
    heads, dn, dv, r, dr, seq = 16, 128, 128, 512, 64, context + 9
    cache = torch.randn(1, 1, seq, r + dr, dtype=torch.bfloat16, device=device)  # [L, S, seq, r + dr]
    w_kv = torch.randn(heads, dn + dv, r, dtype=torch.bfloat16, device=device) * 0.05  # [h, dn + dv, r]
    rows = torch.zeros(1, dtype=torch.long, device=device)  # [B]
    compiled = torch.compile(lambda q, qp, pos: latent_attention.attend(
        q, qp, w_kv, cache.flatten(0, 1).index_select(0, rows), pos, 0.1), options=COMPILE_OPTIONS)
    results = []
    for T in (1, 4):
        q = torch.randn(1, T, heads, dn + dr, dtype=torch.bfloat16, device=device)  # [B, T, h, dn + dr]
        positions = torch.arange(context - T, context, device=device).view(1, T)  # [B, T]
        split = lambda q: torch.split(q, [dn, dr], dim=-1)  # noqa: E731 (the step's views of one projection)
        expected = compiled(*split(q), positions).float()
        row = {"tokens": T, "context": context,
               "compiled_eager_us": graph_us(lambda q: compiled(*split(q), positions), q)}
        kernel = {}
        for chunk, block_s, warps in ATTENTION_CONFIGS:
            latent_attention.CHUNK, latent_attention.BLOCK_S, latent_attention.NUM_WARPS = chunk, block_s, warps
            call = lambda q: latent_attention.latent_attention(  # noqa: E731
                *split(q), w_kv, cache, rows, positions, 0.1)
            error = (call(q).float() - expected).abs().max().item()
            kernel[f"{chunk}/{block_s}/{warps}"] = {"us": graph_us(call, q), "max_abs_error": error}
        best = min(kernel, key=lambda c: kernel[c]["us"])
        row.update(kernel=kernel, best=best, best_us=kernel[best]["us"], expected_max_abs=expected.abs().max().item())
        print(f"attention T={T}, context {context}: compiled eager {row['compiled_eager_us']:.2f} µs, kernels best "
              f"{best} {row['best_us']:.2f} µs (max abs error {kernel[best]['max_abs_error']:.3g} of "
              f"{row['expected_max_abs']:.3g})", flush=True)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--only", choices=["attention", "linear"], help="one of the two tables")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    fused_moe.load_kernels()
    result = {"benchmark": "decode_kernels", "environment": environment()}
    for name, bench in (("attention", lambda: bench_attention(device, args.context)),
                        ("linear", lambda: bench_linear(device))):
        if args.only in (None, name):
            result[name] = bench()
            write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
