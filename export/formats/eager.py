"""Eager: no graph, a reference to the checkpoint; load rebuilds the model and applies `torch.compile`.

The artifact is a small JSON file naming the checkpoint directory, dtype, pool sizes, MoE kind
(export/moe.py) and the decode paths that take Triton kernels (export/kernel_choice.py), plus which step it is
(`target`, or `mtp` with its layer). Loading builds the model once for all files given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from triton_mtp.export.formats import DTYPES, kv_cache_of, set_buffer
from triton_mtp.export.kernel_choice import DEFAULT_DECODE_KERNELS, check_decode_kernels, choose_decode_kernels
from triton_mtp.export.model import DeepseekV3MTP, MTPLayerStep
from triton_mtp.export.moe import MOE_KINDS
from triton_mtp.export.parallel import load_sharded

EXTENSION = "json"


def save(
    step: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    dynamic_shapes: tuple,
    path: Path,
    *,
    checkpoint_dir: Path,
    dtype: str,
    compile: bool = True,
    moe: str = "dense",
    decode_kernels: tuple[str, ...] = DEFAULT_DECODE_KERNELS,
) -> None:
    """Write the reference; `step` is the target or an `MTPLayerStep` (its `layer` is recorded).

    `compile` is the default of `load`: whether the rebuilt steps go through `torch.compile`.
    `moe` is how the rebuilt model runs its routed experts (a kind of export/moe.py), `decode_kernels` which
    decode paths it sends through Triton kernels where they run (export/kernel_choice.py).
    """
    _, pool = kv_cache_of(step)
    _, max_slots, seq_plus_one, _ = pool.shape
    reference = {
        "checkpoint": str(Path(checkpoint_dir).resolve()),
        "dtype": dtype,
        "max_slots": max_slots,
        "max_seq_len": seq_plus_one - 1,
        "step": "mtp" if isinstance(step, MTPLayerStep) else "target",
        "layer": step.layer if isinstance(step, MTPLayerStep) else None,
        "compile": compile,
        "moe": moe,
        "decode_kernels": list(check_decode_kernels(decode_kernels)),
    }
    path.write_text(json.dumps(reference, indent=2) + "\n")


# Inductor keeps a fused kernel's bf16/fp16 intermediates in float32 where eager rounds after every
# op. Over a few layers that drift tips near-tie expert picks, so a compiled target missed the export's
# parity check on the H200 (max relative error 0.21 in bf16, 7e-7 in fp32). Emulating eager's casts
# makes the compiled steps match eager bit for bit there (bench/results/h200-2026-12-04-compile-bisect).
# On CUDA, inductor's matmul padding (pad_mm) asks whether each GEMM is compute-bound, which guards on the token
# count (2-3, 4-15, under 68 tokens, ...): the shapes the decode graphs capture then compiled 3 target variants and
# 1 MTP variant past the warm-up's, which the shipped cache did not hold (bench/results/h100-2026-12-07-run37-*,
# `warm_up/`). Decode GEMMs are memory-bound, where padding does not help.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "shape_padding": False}


# Compiled variants of one step's code (dynamo's recompile_limit, 8 by default). Past the limit dynamo runs the
# step uncompiled, which the served logs showed for MTP calls (runs 29 to 35) and target calls (runs 32 to 35),
# when the MoE guarded on its token bound and each MTP layer compiled its own variants. The served shapes now make
# 4 variants of the target and 4 shared by the MTP layers (WARM_UP_SHAPES's size classes); the limit leaves room
# for guards a checkpoint's config may add.
RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Dynamo's recompile limit at least RECOMPILE_LIMIT, for the process."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before 2.7
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def compile_step(step: nn.Module) -> nn.Module:
    """`torch.compile(step, dynamic=True)` with eager's rounding (COMPILE_OPTIONS), as the steps are served;
    raises dynamo's recompile limit (`raise_recompile_limit`)."""
    raise_recompile_limit()
    return torch.compile(step, dynamic=True, options=COMPILE_OPTIONS)


# torch.compile(dynamic=True) specializes sizes of 1, so batch and token counts of 1 and > 1 each
# compile once.
WARM_UP_SHAPES = ((1, 1), (2, 1), (1, 2), (2, 2))


class EagerGraph:
    """A step module of the rebuilt model, compiled by `compile_step` unless disabled.

    A compiled step is warmed up when its pool is bound: one call per size class, every row padding,
    so the compilation happens at load rather than on the first requests and only the scratch
    position is written.
    """

    explicit_cache = False

    def __init__(self, module: nn.Module, step: nn.Module, compile: bool) -> None:
        self.module = module
        self.cache_fqn, pool = kv_cache_of(module)
        self.cache_shape, self.cache_dtype = tuple(pool.shape), pool.dtype
        self.compiled = compile
        self.step = compile_step(step) if compile else step

    def bind_cache(self, pool: torch.Tensor) -> None:
        set_buffer(self.module, self.cache_fqn, pool)
        if self.compiled:
            self._warm_up(pool.device)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return self.step(*inputs)

    def _warm_up(self, device: torch.device) -> None:
        for B, T in WARM_UP_SHAPES:
            self.call_padding(B, T, device)

    def call_padding(self, B: int, T: int, device: torch.device) -> None:
        """One call of B rows of T padding tokens (position -1: only the scratch position is written)."""
        token_ids = torch.zeros(B, T, dtype=torch.long, device=device)  # [B, T]
        positions = torch.full((B, T), -1, device=device)  # [B, T], all padding
        slot_ids = torch.zeros(B, dtype=torch.long, device=device)  # [B]
        if isinstance(self.module, DeepseekV3MTP):
            hidden = torch.zeros(B, T, self.module.config.hidden_size, dtype=self.module.embed_tokens.weight.dtype,
                                 device=device)  # [B, T, H]
            self(token_ids, hidden, positions, slot_ids)
        else:
            self(token_ids, positions, slot_ids)


def load(
    paths: list[Path], device: torch.device, compile: bool | None = None, rank: int = 0, world_size: int = 1
) -> list[EagerGraph]:
    """Build the model from the checkpoint the files name (they must name the same one).

    `compile` overrides the choice recorded at export. With `world_size` > 1 the model is rank
    `rank`'s tensor-parallel shard (export/parallel.py; the default process group must be up).
    """
    references = [_read_reference(p) for p in paths]
    keys = ("checkpoint", "dtype", "max_slots", "max_seq_len", "compile", "moe", "decode_kernels")
    first = {k: references[0][k] for k in keys}
    for path, ref in zip(paths, references):
        differing = [k for k in keys if ref[k] != first[k]]
        if differing:
            raise ValueError(f"{path}: differs from {paths[0]} in {', '.join(differing)}")
    _, target, mtp = load_sharded(
        first["checkpoint"], rank, world_size, DTYPES[first["dtype"]], device, first["max_slots"], first["max_seq_len"],
        moe=first["moe"],
    )
    choose_decode_kernels(first["decode_kernels"], target, mtp)
    compile = first["compile"] if compile is None else compile
    graphs = []
    for path, ref in zip(paths, references):
        if ref["step"] == "target":
            graphs.append(EagerGraph(target, target, compile))
        elif mtp is None:
            raise ValueError(f"{path}: checkpoint {first['checkpoint']} has no MTP layers")
        else:
            graphs.append(EagerGraph(mtp, mtp.layer_step(ref["layer"]), compile))
    return graphs


def _read_reference(path: Path) -> dict:
    try:
        reference = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
    for key in ("checkpoint", "dtype", "max_slots", "max_seq_len", "step", "layer", "compile"):
        if key not in reference:
            raise ValueError(f"{path}: missing key {key!r}")
    if reference["dtype"] not in DTYPES:
        raise ValueError(f"{path}: key 'dtype' must be one of {', '.join(DTYPES)}, got {reference['dtype']!r}")
    reference.setdefault("moe", "dense")  # written before the MoE kind was recorded
    if reference["moe"] not in MOE_KINDS:
        raise ValueError(f"{path}: key 'moe' must be one of {', '.join(MOE_KINDS)}, got {reference['moe']!r}")
    reference.setdefault("decode_kernels", list(DEFAULT_DECODE_KERNELS))  # written before the choice was recorded
    if not isinstance(reference["decode_kernels"], list):
        raise ValueError(f"{path}: key 'decode_kernels' must be a list of names, got {reference['decode_kernels']!r}")
    try:
        check_decode_kernels(reference["decode_kernels"])
    except ValueError as exc:
        raise ValueError(f"{path}: key {exc}") from None
    return reference
