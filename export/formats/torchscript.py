"""TorchScript: `torch.jit.trace` of the step; the KV pool stays a buffer inside the scripted module."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from triton_mtp.export.formats import cache_fqn, kv_cache_of, set_buffer

EXTENSION = "pt"


def save(step: nn.Module, example_inputs: tuple[torch.Tensor, ...], dynamic_shapes: tuple, path: Path) -> None:
    """Trace `step` on `example_inputs` (the trace keeps B and T symbolic) and save it.

    Tracing runs the step once; its pool is zeroed again afterwards so nothing of the example leaks.
    """
    _, pool = kv_cache_of(step)
    with torch.no_grad():
        traced = torch.jit.trace(step, example_inputs, check_trace=False)
    pool.zero_()
    traced.save(str(path))


class TorchScriptGraph:
    """A loaded TorchScript step; `bind_cache` swaps its pool buffer for a shared tensor."""

    explicit_cache = False

    def __init__(self, path: Path, device: torch.device) -> None:
        self.module = torch.jit.load(str(path), map_location=device).eval()
        buffers = dict(self.module.named_buffers())
        self.cache_fqn = cache_fqn(list(buffers))
        self.cache_shape = tuple(buffers[self.cache_fqn].shape)
        self.cache_dtype = buffers[self.cache_fqn].dtype

    def bind_cache(self, pool: torch.Tensor) -> None:
        set_buffer(self.module, self.cache_fqn, pool)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module(*inputs)


def load(paths: list[Path], device: torch.device) -> list[TorchScriptGraph]:
    return [TorchScriptGraph(p, device) for p in paths]
