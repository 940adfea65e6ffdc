"""Which decode paths a loaded model sends through Triton kernels, where the kernels run (CUDA, once the grouped MoE
loaded them: the eager format on GPUs). The MoE's own kernels (export/fused_moe.py) come with the grouped MoE.

- `linear`: one-token calls of small half-precision weights (export/linear.py), measured faster than cuBLAS
  (docs/benchmarks.md, run 38); on by default.
- `attention`: the absorbed attention of calls of few tokens (export/latent_attention.py); off until measured.
- `router`: the gate's float32 logits of one token through the linear kernel (export/moe.py); off until measured.

`triton-mtp export --decode-kernels` records the choice in the eager artifacts, and their load applies it. The
default is what a model built without a choice (`load_checkpoint`) takes: the modules' class flags.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from triton_mtp.export.linear import Linear
from triton_mtp.export.mla import MLAttention
from triton_mtp.export.moe import Gate

DECODE_KERNELS = {"linear": Linear, "attention": MLAttention, "router": Gate}
DEFAULT_DECODE_KERNELS = tuple(name for name, kind in DECODE_KERNELS.items() if kind.decode_kernel)  # ("linear",)


def parse_decode_kernels(text: str) -> tuple[str, ...]:
    """"linear,attention" -> ("linear", "attention"); "" or "none" -> (). ValueError naming the field otherwise."""
    text = text.strip()
    return () if text in ("", "none") else check_decode_kernels(name.strip() for name in text.split(","))


def check_decode_kernels(names: Iterable[str]) -> tuple[str, ...]:
    names = tuple(names)
    unknown = sorted(set(names) - DECODE_KERNELS.keys())
    if unknown:
        raise ValueError(f"decode_kernels: unknown {', '.join(unknown)} (choose from {', '.join(DECODE_KERNELS)}, "
                         "comma-separated, or none)")
    return tuple(name for name in DECODE_KERNELS if name in names)


def choose_decode_kernels(names: Iterable[str], *models: nn.Module | None) -> None:
    """Send the named decode paths of the given models (None skipped) through their kernels, the others not."""
    chosen = check_decode_kernels(names)
    for model in models:
        if model is not None:
            for module in model.modules():
                for name, kind in DECODE_KERNELS.items():
                    if isinstance(module, kind):
                        module.decode_kernel = name in chosen
