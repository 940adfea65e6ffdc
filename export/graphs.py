"""Export the target and MTP step graphs, load them back as step runners, and check them against eager.

`export_graphs` writes `target.<ext>` and one `mtp_<i>.<ext>` per MTP layer in a format of
`export/formats/` (torchscript, aoti, onnx, eager). `load_step` returns a runner with the step
signature of docs/architecture.md that owns the KV pool: the graphs of one model (the target, or
all MTP layers) write the same pool, and `reset_cache()` zeroes it. `check_parity` replays a prefill
chunk with a padding row, a verify window and a one-token decode step through each artifact and
through the eager modules, and fails with the numbers when they differ.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from triton_mtp.export.formats import DTYPES, FORMATS, format_module, kv_cache_of
from triton_mtp.export.kernel_choice import DEFAULT_DECODE_KERNELS
from triton_mtp.export.model import DeepseekV3MTP, DeepseekV3Target, MTPLayerStep

__all__ = ["DTYPES", "FORMATS", "ParityError", "check_parity", "export_graphs", "load_step"]

TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
EXAMPLE_TOKENS = 4


class ParityError(ValueError):
    """An exported artifact's outputs differ from eager beyond the tolerance; the message has the numbers."""


def export_graphs(
    target: DeepseekV3Target,
    mtp: DeepseekV3MTP | None,
    out_dir: str | Path,
    fmt: str,
    *,
    mtp_dir: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    dtype: str | None = None,
    eager_compile: bool = True,
    moe: str = "dense",
    decode_kernels: tuple[str, ...] = DEFAULT_DECODE_KERNELS,
    on_saved: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Write `target.<ext>` into out_dir and `mtp_<i>.<ext>` into mtp_dir (default out_dir).

    Graphs take any batch up to the pool's slot count and any number of tokens up to its
    `max_seq_len`. The eager format needs `checkpoint_dir` and `dtype` (a key of DTYPES);
    `eager_compile` records whether its load applies `torch.compile`, `moe` its MoE kind (export/moe.py),
    `decode_kernels` the decode paths its load sends through Triton kernels (export/kernel_choice.py).
    Returns {"target": path, "mtp_0": path, ...}; `on_saved(name)` is called after each file.
    """
    module = format_module(fmt)
    options = {}
    if fmt == "eager":
        if checkpoint_dir is None or dtype not in DTYPES:
            raise ValueError("format eager: checkpoint_dir and dtype (fp32, bf16 or fp16) are required")
        options = {"checkpoint_dir": Path(checkpoint_dir), "dtype": dtype, "compile": eager_compile, "moe": moe,
                   "decode_kernels": decode_kernels}
    out_dir = Path(out_dir)
    mtp_dir = Path(mtp_dir) if mtp_dir is not None else out_dir
    steps: dict[str, tuple[nn.Module, Path]] = {"target": (target, out_dir)}
    if mtp is not None:
        for i in range(mtp.config.num_nextn_predict_layers):
            steps[f"mtp_{i}"] = (mtp.layer_step(i), mtp_dir)
    artifacts = {}
    for name, (step, directory) in steps.items():
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.{module.EXTENSION}"
        example_inputs, dynamic_shapes = _example(step, target)
        module.save(step, example_inputs, dynamic_shapes, path, **options)
        artifacts[name] = path
        if on_saved is not None:
            on_saved(name)
    return artifacts


def _example(step: nn.Module, target: DeepseekV3Target) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Example inputs (two rows, the second padded) and dynamic B / T dims for one step module."""
    _, pool = kv_cache_of(step)
    _, max_slots, seq_plus_one, _ = pool.shape
    weight = target.model.embed_tokens.weight  # [V, H]
    B, T = 2, min(EXAMPLE_TOKENS, seq_plus_one - 1)  # batch, tokens
    token_ids = torch.randint(0, weight.shape[0], (B, T), device=weight.device)  # [B, T]
    positions = torch.arange(T, device=weight.device).repeat(B, 1)  # [B, T]
    positions[1, T - 1] = -1
    slot_ids = torch.tensor([0, max_slots - 1], device=weight.device)  # [B]
    batch = torch.export.Dim("batch", min=1, max=max(2, max_slots))
    rows = {0: batch, 1: torch.export.Dim("tokens", min=1, max=max(2, seq_plus_one - 1))}
    if isinstance(step, MTPLayerStep):
        hidden = torch.randn(B, T, weight.shape[1], dtype=weight.dtype, device=weight.device)  # [B, T, H]
        return (token_ids, hidden, positions, slot_ids), (rows, rows, rows, {0: batch})
    return (token_ids, positions, slot_ids), (rows, rows, {0: batch})


class StepRunner:
    """The loaded graphs of one model and the KV pool they all write."""

    def __init__(self, graphs: list, device: torch.device) -> None:
        self.graphs = graphs
        shape, dtype = graphs[0].cache_shape, graphs[0].cache_dtype
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, P + 1, D]
        for graph in graphs:
            if (graph.cache_shape, graph.cache_dtype) != (shape, dtype):
                raise ValueError(f"artifacts disagree on the KV pool: {graph.cache_shape} vs {shape}")
            if not graph.explicit_cache:
                graph.bind_cache(self.kv_cache)

    def reset_cache(self) -> None:
        """Zero the KV pool (every slot)."""
        self.kv_cache.zero_()

    def _run(self, graph, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            if graph.explicit_cache:
                logits, hidden, self.kv_cache = graph(*inputs, self.kv_cache)
                return logits, hidden
            logits, hidden = graph(*inputs)
            return logits, hidden


class TargetRunner(StepRunner):
    """target(token_ids[B, T], positions[B, T], slot_ids[B]) -> logits[B, T, V] f32, hidden[B, T, H]."""

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(self.graphs[0], (token_ids, positions, slot_ids))


class MTPRunner(StepRunner):
    """mtp(token_ids, hidden, positions, slot_ids, layer) -> logits f32, hidden_out; layer i runs graph i % n."""

    def __call__(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(self.graphs[layer % len(self.graphs)], (token_ids, hidden, positions, slot_ids))


def load_step(
    path: str | Path,
    fmt: str,
    device: str | torch.device = "cpu",
    *,
    compile: bool | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> StepRunner:
    """Load `target.<ext>`, or the MTP layers (`mtp_<i>.<ext>`, or a directory holding only those).

    A directory holding `target.<ext>` and no MTP files loads the target. An MTP file loads all its
    `mtp_<i>` siblings, so `layer` picks among them. `compile` (eager format only) overrides the
    choice recorded at export. `world_size` > 1 (eager format only) loads rank `rank`'s
    tensor-parallel shard; serving/parallel.py runs the ranks.
    """
    module = format_module(fmt)
    if world_size > 1 and fmt != "eager":
        raise ValueError(f"format {fmt}: tensor parallelism (--tensor-parallel) needs the eager format")
    device = torch.device(device)
    path = Path(path)
    ext = module.EXTENSION
    directory = path if path.is_dir() else path.parent
    mtp_files = sorted(directory.glob(f"mtp_*.{ext}"), key=_layer_index)
    if path.is_dir():
        target_file = path / f"target.{ext}"
        if target_file.exists() and mtp_files:
            raise ValueError(f"{path}: holds both target.{ext} and mtp_*.{ext}; pass the file to load")
        path = target_file if target_file.exists() else (mtp_files[0] if mtp_files else target_file)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no {fmt} artifact here")
    options = {"compile": compile, "rank": rank, "world_size": world_size} if fmt == "eager" else {}
    if path.name == f"target.{ext}":
        return TargetRunner(module.load([path], device, **options), device)
    if _layer_index(path) < 0:
        raise ValueError(f"{path}: expected target.{ext} or mtp_<i>.{ext}")
    indices = [_layer_index(p) for p in mtp_files]
    if indices != list(range(len(indices))):
        raise ValueError(f"{directory}: MTP layer files must be mtp_0..mtp_{len(indices) - 1}.{ext}, found {indices}")
    return MTPRunner(module.load(mtp_files, device, **options), device)


def _layer_index(path: Path) -> int:
    match = re.fullmatch(r"mtp_(\d+)", path.name.split(".", 1)[0])
    return int(match.group(1)) if match else -1


def check_parity(
    target: DeepseekV3Target,
    mtp: DeepseekV3MTP | None,
    artifacts: dict[str, Path],
    fmt: str,
    *,
    verify_tokens: int = 2,
    tolerance: float | None = None,
    seed: int = 0,
    compile: bool | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Max relative error of each artifact against the eager modules; ParityError beyond `tolerance`.

    Each step replays a prefill chunk (two rows, the second padded), a window of `verify_tokens`
    tokens and a one-token decode step on fresh pools, comparing logits and hidden states at the
    valid positions and the pools (scratch position excluded) afterwards. The error is
    max|artifact - eager| / max|eager|. The eager modules' pools are zeroed before and after.
    `compile` is passed to `load_step`.
    """
    weight = target.model.embed_tokens.weight  # [V, H]
    tolerance = TOLERANCES[weight.dtype] if tolerance is None else tolerance
    errors: dict[str, dict[str, float]] = {}
    runner = load_step(artifacts["target"], fmt, weight.device, compile=compile)
    errors["target"] = _replay(target, runner, None, verify_tokens, seed)
    if mtp is not None:
        runner = load_step(artifacts["mtp_0"], fmt, weight.device, compile=compile)
        for i in range(mtp.config.num_nextn_predict_layers):
            errors[f"mtp_{i}"] = _replay(mtp, runner, i, verify_tokens, seed + 1 + i)
    failed = []
    for name, parts in errors.items():
        worst = max(parts.values())
        log(f"parity {artifacts[name].name}: max relative error {worst:.2e} (tolerance {tolerance:.0e})")
        if not worst <= tolerance:
            numbers = ", ".join(f"{k} {v:.3e}" for k, v in parts.items())
            failed.append(f"{artifacts[name].name} max relative error {max(parts.values()):.3e} ({numbers})")
    if failed:
        raise ParityError(f"parity check failed against eager (tolerance {tolerance:.1e}): {'; '.join(failed)}")
    return {name: max(parts.values()) for name, parts in errors.items()}


def _replay(
    eager: nn.Module, runner: StepRunner, layer: int | None, verify_tokens: int, seed: int
) -> dict[str, float]:
    """Run the same calls through `eager` and `runner` from empty pools; relative errors per output."""
    eager.reset_cache()
    runner.reset_cache()
    worst = {"logits": 0.0, "hidden": 0.0}
    with torch.no_grad():
        for inputs, valid in _parity_calls(eager, layer is not None, verify_tokens, seed):
            extra = () if layer is None else (layer,)
            expected = eager(*inputs, *extra)
            got = runner(*inputs, *extra)
            for key, e, g in zip(worst, expected, got):
                worst[key] = max(worst[key], _relative_error(g[valid], e[valid]))
        worst["kv_cache"] = _relative_error(runner.kv_cache[:, :, :-1], eager.kv_cache[:, :, :-1])
    eager.reset_cache()
    runner.reset_cache()
    return worst


def _parity_calls(
    eager: nn.Module, with_hidden: bool, verify_tokens: int, seed: int
) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """(inputs, valid mask) for a prefill chunk with a padded row, a verify window and a decode step."""
    _, max_slots, seq_plus_one, _ = eager.kv_cache.shape
    max_seq_len = seq_plus_one - 1
    weight = eager.embed_tokens.weight if with_hidden else eager.model.embed_tokens.weight  # [V, H]
    device = weight.device
    gen = torch.Generator().manual_seed(seed)
    window = max(1, min(verify_tokens, max_seq_len - 3))
    prefill = max(2, min(6, max_seq_len - window - 1))
    lengths = torch.tensor([prefill, max(1, prefill - 2)][: min(2, max_slots)])  # [B]
    slot_ids = torch.tensor([max_slots - 1, 0][: len(lengths)], device=device)  # [B]
    starts = torch.zeros_like(lengths)
    calls = []
    for tokens in (prefill, window, 1):
        offsets = torch.arange(tokens)  # [T]
        positions = starts[:, None] + offsets[None, :]  # [B, T]
        positions = torch.where(offsets[None, :] < lengths[:, None], positions, -1).to(device)  # [B, T]
        starts = starts + lengths
        lengths = torch.full_like(lengths, tokens)  # later calls are full rows
        token_ids = torch.randint(0, weight.shape[0], tuple(positions.shape), generator=gen).to(device)  # [B, T]
        inputs: tuple[torch.Tensor, ...] = (token_ids, positions, slot_ids)
        if with_hidden:
            hidden = torch.randn(*positions.shape, weight.shape[1], generator=gen).to(device, weight.dtype)  # [B, T, H]
            inputs = (token_ids, hidden, positions, slot_ids)
        calls.append((inputs, positions >= 0))
    return calls


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected, got = expected.float(), got.float()
    scale = expected.abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    return float((got - expected).abs().max() / scale) if expected.numel() else 0.0
