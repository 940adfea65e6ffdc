"""Fixed-shape step wrappers for decode loops: torch.compile (reduce-overhead), captured CUDA graphs, or eager.

`reduce-overhead` follows gpt-fast: `torch.compile(step, mode="reduce-overhead", fullgraph=True)` on
steps whose input shapes never change, so inductor replays one CUDA graph per shape. `cudagraph`
captures the eager step once with `torch.cuda.CUDAGraph` (serving/graphs.py `CapturedStep`; no
compile time, what a 27-layer model needs to fit the run). Both return outputs that live in static
buffers: a caller that keeps an
output past the next call must clone it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from triton_mtp.export.formats.eager import COMPILE_OPTIONS, raise_recompile_limit
from triton_mtp.serving.graphs import CapturedStep

MODES = ("reduce-overhead", "cudagraph", "eager")
Step = Callable[..., tuple[torch.Tensor, ...]]


def place_rope(module: torch.nn.Module, device: torch.device) -> None:
    """Move the rotary tables' `inv_freq` (a plain float32 attribute, not a buffer) to `device`.

    Otherwise every step copies it from the host, which a CUDA graph capture does not allow.
    """
    for m in module.modules():
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            m.inv_freq = m.inv_freq.to(device)


class CompiledStep:
    """`torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)` with eager's rounding
    (the served steps' COMPILE_OPTIONS) and their recompile limit, one call per loop step."""

    def __init__(self, step: Step) -> None:
        raise_recompile_limit()  # a bench compiles one forward for many shapes and layers
        options = {**torch._inductor.list_mode_options("reduce-overhead"), **COMPILE_OPTIONS}
        self.step = torch.compile(step, fullgraph=True, dynamic=False, options=options)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return self.step(*inputs)


class EagerStep:
    """The step as it is, under no_grad (CPU, or a reference run on GPU)."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return self.step(*inputs)


def wrap_step(step: Step, mode: str, example_inputs: Sequence[torch.Tensor]) -> Step:
    """The step under `mode` (one of MODES); `example_inputs` fix the shapes a captured graph takes."""
    if mode not in MODES:
        raise ValueError(f"graphs: unknown mode {mode!r} (expected one of {', '.join(MODES)})")
    if mode != "eager" and not example_inputs[0].is_cuda:
        raise ValueError(f"graphs: mode {mode!r} needs CUDA tensors; use 'eager' on CPU")
    if mode == "cudagraph":
        return CapturedStep(step, example_inputs)
    if mode == "reduce-overhead":
        return CompiledStep(step)
    return EagerStep(step)
