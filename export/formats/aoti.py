"""AOTInductor: `torch.export.export` with dynamic B and T, compiled by `aoti_compile_and_package` to `.pt2`.

The KV pool is a mutated buffer of the exported program, i.e. a constant of the compiled model that
the kernels write in place. At load the runner hands in its own pool with
`load_constants(..., user_managed=True)`, so writes persist across calls, the MTP layer graphs share
one pool, and zeroing that tensor resets the cache.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from triton_mtp.export.formats import cache_fqn, kv_cache_of

EXTENSION = "pt2"


def save(step: nn.Module, example_inputs: tuple[torch.Tensor, ...], dynamic_shapes: tuple, path: Path) -> None:
    """Export `step` with `dynamic_shapes` and compile it for the device its weights are on."""
    name, pool = kv_cache_of(step)
    with torch.no_grad():
        program = torch.export.export(step, example_inputs, dynamic_shapes=dynamic_shapes)
    metadata = {
        "kv_cache_fqn": name,
        "kv_cache_shape": ",".join(map(str, pool.shape)),
        "kv_cache_dtype": str(pool.dtype).removeprefix("torch."),
    }
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs={"aot_inductor.metadata": metadata}
    )


class AOTIGraph:
    """A loaded `.pt2`; `bind_cache` makes the compiled model write a caller-owned pool."""

    explicit_cache = False

    def __init__(self, path: Path, device: torch.device) -> None:
        self.model = torch._inductor.aoti_load_package(str(path))
        metadata = self.model.get_metadata()
        if metadata.get("AOTI_DEVICE_KEY") != device.type:
            raise ValueError(f"{path}: compiled for device {metadata.get('AOTI_DEVICE_KEY')!r}, not {device.type!r}")
        self.cache_fqn = cache_fqn(self.model.get_constant_fqns())
        self.cache_shape = tuple(int(d) for d in metadata["kv_cache_shape"].split(","))
        self.cache_dtype = getattr(torch, metadata["kv_cache_dtype"])

    def bind_cache(self, pool: torch.Tensor) -> None:
        self.model.load_constants({self.cache_fqn: pool}, check_full_update=False, user_managed=True)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(self.model(*inputs))


def load(paths: list[Path], device: torch.device) -> list[AOTIGraph]:
    return [AOTIGraph(p, device) for p in paths]
