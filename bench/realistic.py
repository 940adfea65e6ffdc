"""Decode-step time of a DeepSeek-V2-Lite-shaped target at batch 1 against its memory-bandwidth floor (P4).

The model is `export.model.DeepseekV3Target` with random bf16 weights made directly on the device (no
checkpoint files): hidden 2048, 27 layers, MLA with kv_lora_rank 512 and no q-LoRA, 64 routed experts
top-6 plus 2 shared (moe_intermediate 1408), first layer dense (10944), vocabulary 102400. One decode
step (one token, context `--context` tokens) is captured as a CUDA graph and replayed; it is timed
with the dense MoE (every expert on every token), then with the grouped MoE the eager export serves on
GPUs (`export.moe`, `MoE.group_experts`: only the selected experts' weights are read) through its
grouped GEMMs ("selected") and through the decode kernels of export/fused_moe.py ("fused"; "fused-apart"
keeps the shared experts as their own MLP instead of folding them into the kernels' picks; "fused-eager-attention"
runs the attention through its eager ops instead of export/latent_attention.py's kernels; "fused-cublas" in
addition every linear layer and the router through cuBLAS instead of the small ones through export/linear.py's
decode kernel; every other grouped variant takes both where Triton runs). Every grouped variant has each
attention's input projections fused (`MLAttention.fuse_input_projections`), as the GPU build loads them. Where
grouped_mm does not run natively for the device and dtype, the grouped variants are left out.
`--profile FILE` writes the kernel table (torch.profiler) of one timed step of the last variant (compiled and
replayed as timed, so the table shows where the step's device time goes beyond the floor) and records the
step's count of device ops in the result.

    floor = (weight bytes touched per step + KV bytes of the context) / copy bandwidth

Copy bandwidth is measured here: a device-to-device copy of `--copy-bytes` moves twice that many bytes
(read + write). Bytes touched count every weight a step reads (the embedding as one row) with all
routed experts (dense) or top-k of them per MoE layer (selected).

    python -m bench.realistic --out realistic.json [--layers 27 --context 512 --device cuda --profile ops.txt]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .common import environment, step_time, synchronize, write_result
from .graphs import place_rope, wrap_step
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.kernel_choice import DECODE_KERNELS, choose_decode_kernels
from triton_mtp.export.model import DeepseekV3Target, group_weights
from triton_mtp.export.moe import MoE, grouped_mm_works
from triton_mtp.export.rope import RotaryEmbedding


def v2_lite_config(layers: int = 27, **overrides) -> ModelConfig:
    """DeepSeek-V2-Lite's shapes in a DeepSeek-V3 config (noaux_tc routing over one group)."""
    d = {
        "model_type": "deepseek_v3", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": layers, "num_attention_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
        "max_position_embeddings": 163840, "norm_topk_prob": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    }
    d.update(overrides)
    return ModelConfig.from_dict(d, source="v2-lite config")


def random_target(config: ModelConfig, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> DeepseekV3Target:
    """The target built on the meta device, then materialised on `device` with random weights (norms 1)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            target = DeepseekV3Target(config, max_slots=1, max_seq_len=max_seq_len)
    finally:
        torch.set_default_dtype(default)
    target = target.to_empty(device=device)
    target.rotary = RotaryEmbedding(config)  # its tables were computed on the meta device
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        for name, buffer in target.named_buffers():
            buffer.zero_()
    place_rope(target, device)
    return target.eval().requires_grad_(False)


def bytes_touched(config: ModelConfig, target: DeepseekV3Target, selected: bool) -> int:
    """Weight bytes one decode step of one token reads: all parameters, embedding as one row, routed experts
    all (dense MoE) or top-k per MoE layer (selected). `target` is the dense model (not yet grouped)."""
    element = target.lm_head.weight.element_size()
    routed = sum(p.numel() for m in target.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    total = sum(p.numel() for p in target.parameters()) - target.model.embed_tokens.weight.numel() + config.hidden_size
    if selected:
        total -= routed - routed * config.num_experts_per_tok // config.n_routed_experts
    return total * element


def kv_bytes(config: ModelConfig, context: int, dtype: torch.dtype) -> int:
    """Latent cache bytes of `context` tokens over all layers."""
    return config.num_hidden_layers * context * config.cache_dim * torch.empty((), dtype=dtype).element_size()


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    """Bytes per second moved by a device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)  # [n]
    dst = torch.empty_like(src)  # [n]
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    return 2 * src.numel() * src.element_size() * repeats / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    overrides = {k: v for k, v in (("hidden_size", args.hidden), ("n_routed_experts", args.experts),
                                   ("vocab_size", args.vocab)) if v}
    config = v2_lite_config(args.layers, **overrides)
    target = random_target(config, args.context + 8, device, dtype)
    bandwidth = copy_bandwidth(device, args.copy_bytes)
    # Fill the context once (prefill), then time the decode step at position `context`.
    with torch.no_grad():
        ids = torch.randint(0, config.vocab_size, (1, args.context), device=device)  # [1, C]
        target(ids, torch.arange(args.context, device=device).view(1, -1), torch.zeros(1, dtype=torch.long, device=device))
    inputs = (torch.zeros(1, 1, dtype=torch.long, device=device),  # token [1, 1]
              torch.full((1, 1), args.context, dtype=torch.long, device=device),  # position [1, 1]
              torch.zeros(1, dtype=torch.long, device=device))  # slot [1]
    kv = kv_bytes(config, args.context, dtype)
    result = {"benchmark": "realistic", "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
              "routed_experts": config.n_routed_experts, "vocab_size": config.vocab_size, "context": args.context,
              "dtype": args.dtype, "device": str(device), "graphs": args.graphs, "environment": environment(),
              "copy_bandwidth_GBps": bandwidth / 1e9, "kv_bytes": kv,
              "params": sum(p.numel() for p in target.parameters()),
              "grouped_mm": grouped_mm_works(device, dtype), "moe": {}}
    selected = bytes_touched(config, target, True)
    dense = bytes_touched(config, target, False)
    variants = {name: dense if name == "dense" else selected for name in args.variants}
    if not result["grouped_mm"] and set(GROUPED) & variants.keys():
        print(f"realistic: grouped_mm does not run for {args.dtype} on {device}; leaving out the grouped MoE", flush=True)
        variants = {name: touched for name, touched in variants.items() if name == "dense"}
    for name, touched in variants.items():
        if name != "dense":
            group_weights(target)
            for module in target.modules():
                if isinstance(module, MoE):
                    module.fused_decode = name != "selected"
                    if name == "fused-apart":
                        module.unfold_shared_experts()
                    else:
                        module.fold_shared_experts()
            choose_decode_kernels(VARIANT_KERNELS.get(name, DECODE_KERNELS), target)
        with torch.no_grad():
            eager_s = step_time(target, inputs, device, max(2, args.repeats // 10))
        step = wrap_step(target, args.graphs, inputs)
        seconds = step_time(step, inputs, device, args.repeats)
        floor = (touched + kv) / bandwidth
        result["moe"][name] = {"weight_bytes_touched": touched, "params_touched": touched // target.lm_head.weight.element_size(),
                               "step_ms": seconds * 1e3, "eager_step_ms": eager_s * 1e3, "floor_ms": floor * 1e3,
                               "step_over_floor": seconds / floor}
        print(f"realistic {name} MoE: step {seconds * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms "
              f"({touched / 1e9:.2f} GB touched), eager {eager_s * 1e3:.2f} ms", flush=True)
        if args.profile and name == list(variants)[-1]:
            result["moe"][name]["device_ops_per_step"] = profile_step(step, inputs, args.profile)
        write_result(args.out, result)  # what is done so far survives a time limit
        del step
    return result


def profile_step(step: Callable[..., object], inputs: tuple[torch.Tensor, ...], path: str) -> int:
    """Write the table of one call of `step` (as timed: a graph replay's kernels are listed one by one), sorted
    by device time; the device ops it ran (CPU: the ops)."""
    cuda = inputs[0].is_cuda
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        step(*inputs)  # warm
        with torch.profiler.profile(activities=activities) as prof:
            step(*inputs)
            synchronize(inputs[0].device)
    events = prof.events()
    ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA) if cuda else len(events)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    Path(path).write_text(f"{ops} {'device ops (kernels, copies, memsets)' if cuda else 'ops'} in one step\n\n"
                          + prof.key_averages().table(sort_by=sort, row_limit=60) + "\n")
    return ops


# The grouped MoE's variants; any order, after dense. Each takes every decode kernel (export/kernel_choice.py) but
# those it names here.
GROUPED = ("selected", "fused-apart", "fused", "fused-eager-attention", "fused-cublas")
VARIANT_KERNELS = {"fused-eager-attention": ("linear", "router"), "fused-cublas": ()}


def parse_variants(text: str) -> list[str]:
    names = text.split(",")
    unknown = set(names) - {"dense", *GROUPED}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown MoE variants {sorted(unknown)} (dense, {', '.join(GROUPED)})")
    if "dense" in names[1:]:  # grouping the experts cannot be undone
        raise argparse.ArgumentTypeError("dense must come first: the grouped variants group the experts for good")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--graphs", default="cudagraph", choices=["cudagraph", "reduce-overhead", "eager"])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache at the timed step")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--copy-bytes", type=int, default=2**31, help="buffer size of the bandwidth measurement")
    parser.add_argument("--hidden", type=int, help="override hidden_size (smoke runs)")
    parser.add_argument("--experts", type=int, help="override n_routed_experts (smoke runs)")
    parser.add_argument("--vocab", type=int, help="override vocab_size (smoke runs)")
    parser.add_argument("--profile", metavar="FILE", help="write the kernel table of one timed step of the last variant here")
    parser.add_argument("--variants", default=["dense", *GROUPED], type=parse_variants,
                        help="MoE variants to time, in order (default: all of them, in this order): dense, "
                             "selected (the grouped GEMMs), fused-apart (grouped, decode steps through "
                             "export/fused_moe.py's kernels, the shared experts their own MLP), fused (the shared "
                             "experts folded into the kernels' picks), fused-eager-attention (fused, the attention "
                             "on eager ops), fused-cublas (that, and the linear layers on cuBLAS)")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
