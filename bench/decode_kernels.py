"""Device time of the decode ops of export/linear.py and export/latent_attention.py against what they replace, per
shape and kernel configuration (bf16, CUDA graphs of back-to-back calls, so no host time is counted).

- linear: F.linear (cuBLAS) and `linear.decode_linear` for each linear shape of the DeepSeek-V2-Lite-shaped step
  (bench/realistic.py) and of the bundled model, at 1 and 4 tokens, over BLOCK_N x BLOCK_K x num_warps;
- attention: `latent_attention.attend` over the gathered rows, compiled as the served step compiles it, and
  `latent_attention.latent_attention`, V2-Lite's heads and ranks at `--context` positions, over CHUNK x BLOCK_S x
  num_warps.

    python -m bench.decode_kernels --out decode_kernels.json
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from triton_mtp.export import fused_moe, latent_attention, linear
from triton_mtp.export.formats.eager import COMPILE_OPTIONS

from .common import environment, write_result

# (name, N, K): V2-Lite's projections, dense MLP and head; the bundled model's.
LINEAR_SHAPES = [("v2-lite q_proj", 3072, 2048), ("v2-lite kv_a", 576, 2048), ("v2-lite o_proj", 2048, 2048),
                 ("v2-lite dense gate/up", 10944, 2048), ("v2-lite dense down", 2048, 10944),
                 ("v2-lite lm_head", 102400, 2048), ("bundled q_b", 192, 128), ("bundled kv_a", 80, 256),
                 ("bundled lm_head", 8192, 256)]
LINEAR_CONFIGS = list(itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8)))  # BLOCK_N, BLOCK_K, num_warps
ATTENTION_CONFIGS = list(itertools.product((32, 64, 128), (4, 8, 16), (4, 8)))  # CHUNK, BLOCK_S, num_warps


def graph_us(call, calls: int = 20, replays: int = 20) -> float:
    """µs a call of `call()`, `calls` of them captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def bench_linear(device: torch.device) -> list[dict]:
    rows = []
    for (name, N, K), T in itertools.product(LINEAR_SHAPES, (1, 4)):
        x = torch.randn(T, K, dtype=torch.bfloat16, device=device)  # [T, K]
        weight = torch.randn(N, K, dtype=torch.bfloat16, device=device) * 0.02  # [N, K]
        row = {"shape": name, "N": N, "K": K, "tokens": T, "cublas_us": graph_us(lambda: F.linear(x, weight))}
        expected = F.linear(x, weight).float()
        kernel = {}
        for block_n, block_k, warps in LINEAR_CONFIGS:
            linear.BLOCK_N, linear.BLOCK_K, linear.NUM_WARPS = block_n, block_k, warps
            error = (linear.decode_linear(x, weight).float() - expected).abs().max().item()
            kernel[f"{block_n}x{block_k}/{warps}"] = {"us": graph_us(lambda: linear.decode_linear(x, weight)),
                                                     "max_abs_error": error}
        best = min(kernel, key=lambda c: kernel[c]["us"])
        row.update(kernel=kernel, best=best, best_us=kernel[best]["us"])
        print(f"linear {name} T={T}: cuBLAS {row['cublas_us']:.2f} µs, kernel best {best} {row['best_us']:.2f} µs",
              flush=True)
        rows.append(row)
    return rows


def bench_attention(device: torch.device, context: int) -> list[dict]:
    heads, r, dr, seq = 16, 512, 64, context + 9
    cache = torch.randn(1, 1, seq, r + dr, dtype=torch.bfloat16, device=device)  # [L, S, seq, r + dr]
    rows_ = torch.zeros(1, dtype=torch.long, device=device)  # [B]
    compiled = torch.compile(lambda q, qp, pos: latent_attention.attend(
        q, qp, cache.flatten(0, 1).index_select(0, rows_), pos, 0.1), options=COMPILE_OPTIONS)
    results = []
    for T in (1, 4):
        q = torch.randn(1, T, heads, r, dtype=torch.bfloat16, device=device)  # [B, T, h, r]
        qp = torch.randn(1, T, heads, dr, dtype=torch.bfloat16, device=device)  # [B, T, h, dr]
        positions = torch.arange(context - T, context, device=device).view(1, T)  # [B, T]
        expected = compiled(q, qp, positions).float()
        row = {"tokens": T, "context": context, "compiled_eager_us": graph_us(lambda: compiled(q, qp, positions))}
        kernel = {}
        for chunk, block_s, warps in ATTENTION_CONFIGS:
            latent_attention.CHUNK, latent_attention.BLOCK_S, latent_attention.NUM_WARPS = chunk, block_s, warps
            call = lambda: latent_attention.latent_attention(q, qp, cache, rows_, positions, 0.1)  # noqa: E731
            error = (call().float() - expected).abs().max().item()
            kernel[f"{chunk}/{block_s}/{warps}"] = {"us": graph_us(call), "max_abs_error": error}
        best = min(kernel, key=lambda c: kernel[c]["us"])
        row.update(kernel=kernel, best=best, best_us=kernel[best]["us"])
        print(f"attention T={T}, context {context}: compiled eager {row['compiled_eager_us']:.2f} µs, kernels best "
              f"{best} {row['best_us']:.2f} µs", flush=True)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    fused_moe.load_kernels()
    result = {"benchmark": "decode_kernels", "environment": environment()}
    result["attention"] = bench_attention(device, args.context)
    write_result(args.out, result)
    result["linear"] = bench_linear(device)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
