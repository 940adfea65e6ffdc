"""DeepSeek-V3 model configuration, parsed from a checkpoint's config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from triton_mtp.export.errors import CheckpointError

_REQUIRED_INT = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "first_k_dense_replace", "max_position_embeddings",
)
_REQUIRED_FLOAT = ("routed_scaling_factor",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The config.json fields of a DeepSeek-V3 checkpoint that the model needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    max_position_embeddings: int
    routed_scaling_factor: float
    q_lora_rank: int | None = None
    norm_topk_prob: bool = True
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Width of one cached token per layer: compressed latent ‖ roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers from `first_k_dense_replace` on (every `moe_layer_freq`-th) use the MoE MLP."""
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a config.json dict; raise CheckpointError naming `source` and the bad key."""
        model_type = d.get("model_type")
        if model_type != "deepseek_v3":
            raise CheckpointError(f"{source}: unsupported model_type {model_type!r} (expected 'deepseek_v3')")
        for key in _REQUIRED_INT + _REQUIRED_FLOAT:
            if key not in d or d[key] is None:
                raise CheckpointError(f"{source}: missing required key {key!r}")
        for key in _REQUIRED_INT:
            if not _is_int(d[key]) or d[key] < 0:
                raise CheckpointError(f"{source}: key {key!r} must be a non-negative integer, got {d[key]!r}")
        if not _is_int(d.get("q_lora_rank", 0) or 0):
            raise CheckpointError(f"{source}: key 'q_lora_rank' must be an integer or null, got {d['q_lora_rank']!r}")
        expected = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "hidden_act": "silu"}
        for key, value in expected.items():
            if d.get(key, value) != value:
                raise CheckpointError(f"{source}: unsupported {key} {d[key]!r} (expected {value!r})")
        if d["n_routed_experts"] % max(d["n_group"], 1) != 0:
            raise CheckpointError(f"{source}: key 'n_routed_experts' must be divisible by 'n_group'")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind != "yarn":
                raise CheckpointError(f"{source}: unsupported rope_scaling type {kind!r} (expected 'yarn')")
            for key in ("factor", "original_max_position_embeddings"):
                if key not in rope_scaling:
                    raise CheckpointError(f"{source}: missing required key 'rope_scaling.{key}'")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "ModelConfig":
        """Read `<checkpoint_dir>/config.json`."""
        path = Path(checkpoint_dir) / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return cls.from_dict(d, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """A config.json dict (with `model_type`) that `from_dict` parses back to an equal config."""
        return {"model_type": "deepseek_v3", **dataclasses.asdict(self)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
