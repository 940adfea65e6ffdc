"""Tensor parallelism (and expert parallelism for the routed experts) of the eager target and MTP.

Megatron-LM's scheme, applied in place to modules already built and loaded, one rank per process
(`torch.distributed`: NCCL on GPUs, gloo on CPU). Parameter names stay the checkpoint's (grouped
experts are the MoE's stacked `w13` / `w2`, export/moe.py):

- MLA (`self_attn`): split by attention head. `q_b_proj` (or `q_proj`) and `kv_b_proj` keep this
  rank's heads' output rows, `o_proj` the matching input columns; the block output is a partial
  sum, all-reduced. `q_a_proj`, `kv_a_proj_with_mqa` and the norms stay replicated, so every rank
  computes and holds the whole latent cache (as vLLM does for MLA): 70,272 bytes per token per
  rank for DeepSeek-V3 in bf16 ((512 + 64) × 61 layers × 2), against 624,640 for the per-head keys
  and values of 128 / 8 heads over 8 ranks (16 × (192 + 128) × 61 × 2).
- Dense MLP and shared experts: `gate_proj` / `up_proj` column-parallel, `down_proj` row-parallel.
- Routed experts: expert-parallel. Rank r keeps experts [r·E/W, (r+1)·E/W) (modules, or slices of
  the stacked weights once grouped) and weighs them for every token; the gate stays replicated (it
  routes over all experts) and hands each rank its columns. Routed and shared partial sums are
  added before the MoE's one all-reduce.
- `lm_head` (the MTP's `shared_head.head` is the same module): vocab-parallel rows, all-gathered
  along the vocabulary so every rank returns full logits. Embeddings stay replicated.

Collectives per decoder layer (target and MTP alike): two all-reduces of [B, T, H], one after
attention and one after the MLP / MoE; per step one all-gather of the logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.mla import MLAttention
from triton_mtp.export.model import DecoderLayer, DeepseekV3MTP, DeepseekV3Target, group_weights
from triton_mtp.export.moe import MLP, MoE


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """One-line ValueError when `world_size` ranks cannot split this model evenly."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {world_size}")
    layers = range(config.num_hidden_layers + config.num_nextn_predict_layers)
    sizes = {"num_attention_heads": config.num_attention_heads, "vocab_size": config.vocab_size}
    if not all(config.is_moe_layer(i) for i in layers):
        sizes["intermediate_size"] = config.intermediate_size
    if any(config.is_moe_layer(i) for i in layers):
        sizes["n_routed_experts"] = config.n_routed_experts
        if config.n_shared_experts:
            sizes["shared experts' intermediate size"] = config.moe_intermediate_size * config.n_shared_experts
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(f"tensor_parallel_size: {world_size} does not divide {name} ({size})")


def shard_models(
    target: DeepseekV3Target,
    mtp: DeepseekV3MTP | None,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Keep rank `rank`'s shard of every layer and add the collectives; world_size 1 changes nothing.

    `group` (default: the default process group) is looked up when the collectives run, so the
    modules can be sharded before `init_process_group`.
    """
    check_tensor_parallel(target.config, world_size)
    if world_size == 1:
        return
    layers = list(target.model.layers) + (list(mtp.model.layers.values()) if mtp is not None else [])
    for layer in layers:
        _shard_layer(layer, rank, world_size, group)
    _shard_linear(target.lm_head, 0, rank, world_size)
    target.lm_head.register_forward_hook(_AllGatherLast(world_size, group))


def load_sharded(
    checkpoint_dir: str | Path,
    rank: int,
    world_size: int,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_slots: int = 4,
    max_seq_len: int | None = None,
    group: dist.ProcessGroup | None = None,
    moe: str = "dense",
) -> tuple[ModelConfig, DeepseekV3Target, DeepseekV3MTP | None]:
    """`load_checkpoint`, then `shard_models` for this rank, then `moe` "grouped" stacks this rank's experts and fuses
    its attention input projections.

    Every rank streams the whole checkpoint onto `device` and then drops what it does not hold,
    which needs the unsharded model to fit there once. For DeepSeek-V3 size, the next step is to
    read only this rank's slices (safetensors `get_slice`) into modules built at the shard's size.
    """
    check_tensor_parallel(ModelConfig.from_checkpoint(checkpoint_dir), world_size)  # before the long load
    config, target, mtp = load_checkpoint(checkpoint_dir, dtype, device, max_slots, max_seq_len, progress=False)
    shard_models(target, mtp, rank, world_size, group)
    if moe == "grouped":
        group_weights(target, mtp)
    return config, target, mtp


def _shard_layer(layer: DecoderLayer, rank: int, world_size: int, group: dist.ProcessGroup | None) -> None:
    """Shard attention and MLP / MoE; each block's output becomes a partial sum, all-reduced by a hook."""
    _shard_attention(layer.self_attn, rank, world_size)
    if isinstance(layer.mlp, MoE):
        _shard_moe(layer.mlp, rank, world_size)
    else:
        _shard_mlp(layer.mlp, rank, world_size)
    for block in (layer.self_attn, layer.mlp):
        block.register_forward_hook(_AllReduce(group))


def _shard_attention(attn: MLAttention, rank: int, world_size: int) -> None:
    """Keep heads [rank·h/W, (rank+1)·h/W): rows of the per-head projections are head-major."""
    _shard_linear(attn.q_b_proj if attn.q_lora else attn.q_proj, 0, rank, world_size)  # [h/W · dqk, *]
    _shard_linear(attn.kv_b_proj, 0, rank, world_size)  # [h/W · (dn + dv), r]
    _shard_linear(attn.o_proj, 1, rank, world_size)  # [H, h/W · dv]
    attn.num_heads //= world_size


def _shard_mlp(mlp: MLP, rank: int, world_size: int) -> None:
    _shard_linear(mlp.gate_proj, 0, rank, world_size)  # [I/W, H]
    _shard_linear(mlp.up_proj, 0, rank, world_size)  # [I/W, H]
    _shard_linear(mlp.down_proj, 1, rank, world_size)  # [H, I/W]


def _shard_moe(moe: MoE, rank: int, world_size: int) -> None:
    per_rank = moe.gate.num_experts // world_size
    first = rank * per_rank
    moe.first_expert = first
    if moe.grouped:
        moe.unfold_shared_experts()  # the shared MLP splits by columns, not by whole experts
        moe.w13 = nn.Parameter(moe.w13[first : first + per_rank].clone(), requires_grad=False)  # [E/W, 2I, H]
        moe.w2 = nn.Parameter(moe.w2[first : first + per_rank].clone(), requires_grad=False)  # [E/W, H, I]
    else:
        moe.experts = nn.ModuleList(moe.experts[first : first + per_rank])
    moe.gate.register_forward_hook(_Columns(first, first + per_rank))
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, rank, world_size)
    if moe.grouped:
        moe.fold_shared_experts()  # where this rank's columns are whole experts


def _shard_linear(linear: nn.Linear, dim: int, rank: int, world_size: int) -> None:
    """Keep this rank's 1/W of the weight along `dim` (0: output rows, 1: input columns)."""
    weight = linear.weight.detach().chunk(world_size, dim=dim)[rank].clone()  # [out, in] / W along dim
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


@dataclasses.dataclass
class _AllReduce:
    """Forward hook: sum the block's partial output over the group, in place."""

    group: dist.ProcessGroup | None

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=self.group)  # [B, T, H]
        return output


@dataclasses.dataclass
class _AllGatherLast:
    """Forward hook: concatenate every rank's slice of the last dim (rank order)."""

    world_size: int
    group: dist.ProcessGroup | None

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(output) for _ in range(self.world_size)]  # W × [B, T, V/W]
        dist.all_gather(parts, output.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)  # [B, T, V]


@dataclasses.dataclass
class _Columns:
    """Forward hook on the gate: this rank's experts' routing weights out of all experts'."""

    start: int
    stop: int

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output[:, self.start : self.stop]  # [N, E/W]
