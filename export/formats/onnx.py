"""ONNX: `torch.onnx.export` (dynamo) of the step with the KV pool as an explicit input and output.

ONNX graphs hold no state, so the exported graph is `(inputs..., kv_cache) -> (logits, hidden,
kv_cache_out)`; the runner owns the pool and feeds each call's `kv_cache_out` to the next call.
onnxruntime runs it with I/O binding on torch tensors (CPU or CUDA execution provider), so inputs
and outputs are not copied through numpy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from triton_mtp.export.formats import kv_cache_of

EXTENSION = "onnx"

T = torch.Tensor

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
_TORCH = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(int64)": torch.int64}


class _PoolAsIO(nn.Module):
    """Runs `step` on a copy of the pool handed in and returns that copy as a third output."""

    def __init__(self, step: nn.Module) -> None:
        super().__init__()
        self.step = step
        self.pool_name, _ = kv_cache_of(step)

    def _run(
        self, inputs: tuple[torch.Tensor, ...], kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = kv_cache.clone()  # [L, S, P + 1, D]
        logits, hidden = torch.func.functional_call(self.step, {self.pool_name: pool}, inputs, strict=False)
        return logits, hidden, pool


class _TargetPoolIO(_PoolAsIO):
    """Target step; the argument names become the ONNX input names."""

    def forward(self, token_ids: T, positions: T, slot_ids: T, kv_cache: T) -> tuple[T, T, T]:
        return self._run((token_ids, positions, slot_ids), kv_cache)


class _MTPPoolIO(_PoolAsIO):
    """MTP layer step; the argument names become the ONNX input names."""

    def forward(self, token_ids: T, hidden: T, positions: T, slot_ids: T, kv_cache: T) -> tuple[T, T, T]:
        return self._run((token_ids, hidden, positions, slot_ids), kv_cache)


def save(step: nn.Module, example_inputs: tuple[torch.Tensor, ...], dynamic_shapes: tuple, path: Path) -> None:
    """Export `step` with the pool appended to its inputs; the input names are the step's argument names."""
    _, pool = kv_cache_of(step)
    if pool.dtype not in _NUMPY:
        raise ValueError(f"format onnx: dtype {str(pool.dtype).removeprefix('torch.')} is not supported (use fp32 or fp16)")
    wrapper = _MTPPoolIO(step) if len(example_inputs) == 4 else _TargetPoolIO(step)
    optimizer_log = logging.getLogger("onnxscript.optimizer")
    level = optimizer_log.level
    optimizer_log.setLevel(logging.ERROR)  # it warns once per unfoldable Split node
    try:
        _export(wrapper, example_inputs, pool, dynamic_shapes, path)
    finally:
        optimizer_log.setLevel(level)


def _export(wrapper: nn.Module, example_inputs: tuple, pool: torch.Tensor, dynamic_shapes: tuple, path: Path) -> None:
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            (*example_inputs, torch.zeros_like(pool)),
            str(path),
            output_names=["logits", "hidden_out", "kv_cache_out"],
            dynamic_shapes=(*dynamic_shapes, None),
            dynamo=True,
            external_data=True,
            verbose=False,
        )


class OnnxGraph:
    """An onnxruntime session over one exported step."""

    explicit_cache = True

    def __init__(self, path: Path, device: torch.device) -> None:
        provider = "CUDAExecutionProvider" if device.type == "cuda" else "CPUExecutionProvider"
        if provider not in ort.get_available_providers():
            raise ValueError(f"{path}: onnxruntime has no {provider} here")
        self.session = ort.InferenceSession(str(path), providers=[provider])
        self.device = device
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = {o.name: o for o in self.session.get_outputs()}
        pool = self.session.get_inputs()[-1]
        self.cache_shape = tuple(pool.shape)
        self.cache_dtype = _TORCH[pool.type]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T = inputs[0].shape  # batch, tokens
        binding = self.session.io_binding()
        index = self.device.index or 0
        inputs = tuple(t.contiguous() for t in inputs)
        for name, tensor in zip(self.inputs, inputs):
            binding.bind_input(name, self.device.type, index, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
        results = []
        for name, meta in self.outputs.items():
            shape = self.cache_shape if name == "kv_cache_out" else (B, T, meta.shape[-1])
            out = torch.empty(shape, dtype=_TORCH[meta.type], device=self.device)
            binding.bind_output(name, self.device.type, index, _NUMPY[out.dtype], shape, out.data_ptr())
            results.append(out)
        self.session.run_with_iobinding(binding)
        return tuple(results)


def load(paths: list[Path], device: torch.device) -> list[OnnxGraph]:
    return [OnnxGraph(p, device) for p in paths]
