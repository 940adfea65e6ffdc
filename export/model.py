"""DeepSeek-V3 target model and its Multi-Token-Prediction (MTP) layers, with a slot/position KV pool.

Implements the "Model step contract" of docs/architecture.md. Parameter names are the checkpoint's, so
a DeepSeek-V3 state dict loads with `load_state_dict(strict=True)`. Math follows DeepSeek-V3's reference
and transformers' `DeepseekV3ForCausalLM`; shapes are static and the cache is written with
`index_copy_`, so the steps trace, export and convert to ONNX.
"""

from __future__ import annotations

import torch
from torch import nn

from triton_mtp.export.config import ModelConfig
from triton_mtp.export.linear import Linear
from triton_mtp.export.mla import MLAttention, RMSNorm
from triton_mtp.export.moe import MLP, MoE
from triton_mtp.export.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP/MoE blocks with residuals."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config)
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        cache: torch.Tensor,
        cache_layer: int | torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, slot_ids, cache, cache_layer)  # [B, T, H]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T, H]


def _kv_pool(config: ModelConfig, num_layers: int, max_slots: int, max_seq_len: int) -> torch.Tensor:
    """Zeroed cache [L, max_slots, max_seq_len + 1, kv_lora_rank + rope_dim]; the last position is scratch."""
    return torch.zeros(num_layers, max_slots, max_seq_len + 1, config.cache_dim)


class _Backbone(nn.Module):
    """`model.*` of the target: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3Target(nn.Module):
    """The target model: `target(token_ids, positions, slot_ids) -> (logits float32, hidden after model.norm)`."""

    def __init__(self, config: ModelConfig, max_slots: int, max_seq_len: int) -> None:
        super().__init__()
        self.config, self.max_slots, self.max_seq_len = config, max_slots, max_seq_len
        self.model = _Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        self.register_buffer("kv_cache", _kv_pool(config, config.num_hidden_layers, max_slots, max_seq_len),
                             persistent=False)

    def reset_cache(self) -> None:
        """Zero the KV pool (every slot)."""
        self.kv_cache.zero_()

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids[B, T], positions[B, T] (-1 = padding), slot_ids[B] -> logits[B, T, V] f32, hidden[B, T, H]."""
        x = self.model.embed_tokens(token_ids)  # [B, T, H]
        cos, sin = self.rotary(positions.clamp(min=0), x.dtype)  # [B, T, rope_dim] each
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, positions, slot_ids, self.kv_cache, i)  # [B, T, H]
        hidden = self.model.norm(x)  # [B, T, H]
        return self.lm_head(hidden).float(), hidden


class _SharedHead(nn.Module):
    """`shared_head.norm`; the projection (`shared_head.head`) is the target's lm_head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One MTP depth: eh_proj(enorm(embed) ‖ hnorm(hidden)) -> decoder layer -> shared_head.norm."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = _SharedHead(config)


class _MTPLayers(nn.Module):
    """Holds `layers.{N+i}` so MTP parameter names match the checkpoint's `model.layers.{N+i}.*`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n = config.num_hidden_layers
        self.layers = nn.ModuleDict(
            {str(n + i): MTPLayer(config, n + i) for i in range(config.num_nextn_predict_layers)}
        )


_SHARED = ("embed_tokens.weight", "head.weight")


class DeepseekV3MTP(nn.Module):
    """MTP layers: `mtp(token_ids, hidden, positions, slot_ids, layer) -> (logits float32, hidden_out)`.

    `embed_tokens` and `head` are the target's `model.embed_tokens` and `lm_head` modules (one copy in
    memory). They are registered, so exports see them as parameters, but left out of `state_dict()` and
    not expected by `load_state_dict()`: the MTP's state dict is exactly its `model.layers.{N+i}.*`.
    """

    def __init__(self, config: ModelConfig, target: DeepseekV3Target, max_slots: int, max_seq_len: int) -> None:
        super().__init__()
        if config.num_nextn_predict_layers < 1:
            raise ValueError("config: num_nextn_predict_layers must be >= 1 to build the MTP")
        self.config, self.max_slots, self.max_seq_len = config, max_slots, max_seq_len
        self.embed_tokens = target.model.embed_tokens
        self.head = target.lm_head
        self.model = _MTPLayers(config)
        self.rotary = RotaryEmbedding(config)
        self.register_buffer("kv_cache", _kv_pool(config, config.num_nextn_predict_layers, max_slots, max_seq_len),
                             persistent=False)
        self.register_state_dict_post_hook(_drop_shared_keys)
        self.register_load_state_dict_post_hook(_ignore_missing_shared_keys)

    def reset_cache(self) -> None:
        """Zero the KV pool (every slot, every MTP layer)."""
        self.kv_cache.zero_()

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row t pairs embed(token_ids[:, t]) with hidden[:, t]; uses MTP layer `layer % num_nextn_predict_layers`."""
        k = layer % self.config.num_nextn_predict_layers
        return self.run_layer(self.mtp_layer(k), k, token_ids, hidden, positions, slot_ids)

    def mtp_layer(self, k: int) -> MTPLayer:
        """MTP layer k (of `num_nextn_predict_layers`)."""
        return self.model.layers[str(self.config.num_hidden_layers + k)]

    def run_layer(
        self,
        block: MTPLayer,
        cache_layer: int | torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`block` (one of this model's layers) over its pool layer `cache_layer` -> (logits float32, hidden_out)."""
        embed = self.embed_tokens(token_ids)  # [B, T, H]
        x = block.eh_proj(torch.cat([block.enorm(embed), block.hnorm(hidden.to(embed.dtype))], dim=-1))  # [B, T, H]
        cos, sin = self.rotary(positions.clamp(min=0), x.dtype)  # [B, T, rope_dim] each
        x = block(x, cos, sin, positions, slot_ids, self.kv_cache, cache_layer)  # [B, T, H]
        hidden_out = block.shared_head.norm(x)  # [B, T, H]
        return self.head(hidden_out).float(), hidden_out

    def layer_step(self, layer: int) -> "MTPLayerStep":
        """A module whose forward(token_ids, hidden, positions, slot_ids) runs MTP layer `layer` (0 <= layer <
        num_nextn_predict_layers)."""
        return MTPLayerStep(self, layer)


class MTPLayerStep(nn.Module):
    """One fixed MTP layer of a `DeepseekV3MTP` (one exported artifact per layer; one compiled graph for all).

    The layer's module and its pool layer (a 0-d tensor) are what differ between the steps of two layers, so
    `torch.compile` traces one graph for all of them (module parameters and buffers are the graph's inputs):
    a compiled MTP compiles its size classes once, not once per layer.
    """

    def __init__(self, mtp: DeepseekV3MTP, layer: int) -> None:
        super().__init__()
        self.mtp, self.layer = mtp, layer
        self.block = mtp.mtp_layer(layer)
        self.register_buffer("cache_layer", torch.tensor(layer, device=mtp.kv_cache.device), persistent=False)

    def reset_cache(self) -> None:
        self.mtp.reset_cache()

    def forward(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mtp.run_layer(self.block, self.cache_layer, token_ids, hidden, positions, slot_ids)


def group_weights(*models: nn.Module | None) -> None:
    """The grouped (GPU) build's weights, rewritten once loaded: each MoE's experts stacked (`MoE.group_experts`)
    and each attention's input projections fused (`MLAttention.fuse_input_projections`), in the given models (None
    skipped). Both are no-ops a second time."""
    for model in models:
        if model is not None:
            for module in list(model.modules()):
                if isinstance(module, MoE):
                    module.group_experts()
                elif isinstance(module, MLAttention):
                    module.fuse_input_projections()


def _drop_shared_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name in _SHARED:
        state_dict.pop(prefix + name, None)


def _ignore_missing_shared_keys(module: nn.Module, incompatible_keys) -> None:
    """Missing keys are named from the module `load_state_dict` was called on, which may wrap the MTP."""
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if not any(k == s or k.endswith("." + s) for s in _SHARED)]
