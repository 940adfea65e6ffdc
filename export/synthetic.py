"""Tiny random checkpoints in the DeepSeek-V3 Hugging Face layout, MTP layers included.

The weights come from `transformers.DeepseekV3ForCausalLM` (random init, saved under the checkpoint
names transformers itself writes), built with `num_hidden_layers + num_nextn_predict_layers`
decoder layers: the extra layers become the MTP layers' decoder blocks, completed with DeepSeek's
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and the duplicated `shared_head.head` /
`embed_tokens`. FP8 checkpoints follow DeepSeek-V3's release: linear weights of attention and MLP
as float8_e4m3fn with float32 `weight_scale_inv` block scales; embeddings, norms, the router gate,
its bias, `eh_proj` and the heads stay unquantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.core_model_loading import revert_weight_conversion

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """The float32 state dict of a random checkpoint, keyed by checkpoint tensor names.

    Norm weights are 1 + noise and the router's `e_score_correction_bias` is random, so a loader
    that mixes up two norms or drops the bias changes the outputs.
    """
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config key 'moe_layer_freq': synthetic checkpoints need 1, got {cfg['moe_layer_freq']!r}")
    n_target = cfg["num_hidden_layers"]
    n_mtp = cfg.get("num_nextn_predict_layers", 0)
    hidden = cfg["hidden_size"]
    std = cfg.get("initializer_range", 0.02)
    hf_config = DeepseekV3Config(**{**cfg, "num_hidden_layers": n_target + n_mtp})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(hf_config)
    weights = {k: v.detach().clone() for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def noise(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + noise(*tensor.shape, scale=0.1)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = noise(*tensor.shape, scale=0.5)
    for i in range(n_mtp):
        prefix = f"model.layers.{n_target + i}."
        weights[prefix + "enorm.weight"] = 1.0 + noise(hidden, scale=0.1)  # [H]
        weights[prefix + "hnorm.weight"] = 1.0 + noise(hidden, scale=0.1)  # [H]
        weights[prefix + "eh_proj.weight"] = noise(hidden, 2 * hidden, scale=std)  # [H, 2H]
        weights[prefix + "shared_head.norm.weight"] = 1.0 + noise(hidden, scale=0.1)  # [H]
        weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()  # [V, H]
        weights[prefix + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()  # [V, H]
    return weights


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether DeepSeek-V3 ships this tensor in FP8: the linear weights of attention and MLP."""
    return (
        tensor.ndim == 2
        and name.endswith(".weight")
        and (".self_attn." in name or ".mlp." in name)
        and "layernorm" not in name
        and not name.endswith(".mlp.gate.weight")
    )


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantization; returns (fp8 weight [R, C], float32 scale_inv [ceil(R/b0), ceil(C/b1)]).

    Each block is divided by scale_inv = amax(block) / 448; edge blocks are zero-padded to the block
    size for their amax, as in DeepSeek-V3's `weight_dequant`.
    """
    rows, cols = weight.shape
    b0, b1 = block
    n0, n1 = -(-rows // b0), -(-cols // b1)
    padded = torch.nn.functional.pad(weight.float(), (0, n1 * b1 - cols, 0, n0 * b0 - rows))  # [n0*b0, n1*b1]
    blocks = padded.view(n0, b0, n1, b1)  # [n0, b0, n1, b1]
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [n0, n1]
    quantized = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)  # [n0, b0, n1, b1]
    return quantized.view(n0 * b0, n1 * b1)[:rows, :cols].contiguous(), scale_inv


def write_checkpoint(
    out_dir: str | Path,
    cfg: dict[str, Any],
    seed: int = 0,
    shards: int = 1,
    fp8: bool = False,
    block_size: int = 128,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json and safetensors weights of a random checkpoint into `out_dir`.

    shards == 1 writes `model.safetensors`; more writes `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`. Unquantized tensors are stored as `dtype`; the router bias and
    FP8 scales as float32. The block size comes from `cfg["quantization_config"]["weight_block_size"]`
    when present, else `block_size` squared. The same `cfg` and `seed` with fp8=False write the
    unquantized twin of an FP8 checkpoint (`random_weights` returns it in memory).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in cfg.items() if k != "quantization_config"}
    config.setdefault("num_nextn_predict_layers", 0)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = {}
    if fp8:
        quant = cfg.get("quantization_config") or {}
        block = tuple(quant.get("weight_block_size", (block_size, block_size)))
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic",
        }
    for name, tensor in random_weights(cfg, seed).items():
        if fp8 and is_fp8_weight(name, tensor):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensor, block)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = tensor
        else:
            tensors[name] = tensor.to(dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_shards(out, tensors, shards)
    return out


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(np.array_split(sorted(tensors), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names.tolist(), file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
