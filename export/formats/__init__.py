"""One module per artifact format; each saves a step module and loads it back as graphs.

A step module is `DeepseekV3Target` or `MTPLayerStep`: forward(*inputs) -> (logits, hidden), writing
the KV pool buffer `kv_cache` in place. Every format module exposes

    EXTENSION: str
    save(step, example_inputs, dynamic_shapes, path, **options) -> None
    load(paths, device, **options) -> list[Graph]

A loaded `Graph` reports the pool it expects (`cache_fqn`, `cache_shape`, `cache_dtype`) and is
called either in place (`explicit_cache` false: `bind_cache(pool)` once, then graph(*inputs) ->
(logits, hidden)) or with the pool as a last input and a new pool as a last output (`explicit_cache`
true, ONNX: graph(*inputs, pool) -> (logits, hidden, pool)).
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

import torch
from torch import nn

FORMATS = ("torchscript", "aoti", "onnx", "eager")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HOPS = ("bls", "local")  # how `spec_decode` reaches the workers: BLS calls into `target` / `mtp`, or in process


def format_module(fmt: str) -> ModuleType:
    """The module implementing `fmt`; ValueError names the bad format."""
    if fmt not in FORMATS:
        raise ValueError(f"format: unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
    return import_module(f"{__name__}.{fmt}")


def cache_fqn(names: list[str]) -> str:
    """The one name among a module's buffer names that is the KV pool (`...kv_cache`)."""
    found = [n for n in names if n.rsplit(".", 1)[-1] == "kv_cache"]
    if len(found) != 1:
        raise ValueError(f"step module: expected one 'kv_cache' buffer, found {found}")
    return found[0]


def kv_cache_of(step: nn.Module) -> tuple[str, torch.Tensor]:
    """(name, tensor) of the step module's KV pool buffer."""
    buffers = dict(step.named_buffers())
    name = cache_fqn(list(buffers))
    return name, buffers[name]


def set_buffer(module: nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    """Point the (possibly nested, possibly scripted) buffer `fqn` at `tensor`."""
    *parents, leaf = fqn.split(".")
    for name in parents:
        module = getattr(module, name)
    setattr(module, leaf, tensor)
