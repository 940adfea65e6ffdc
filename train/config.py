"""Architecture of the bundled tiny DeepSeek-V3: every feature the loader supports, at small width.

MLA with a q-LoRA, a dense first layer then MoE layers (routed + shared experts, grouped noaux_tc
sigmoid routing), YaRN RoPE, and two MTP layers (`num_nextn_predict_layers: 2`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_mtp.train.tokenizer import SPECIAL_TOKENS


def bundled_model_config(vocab_size: int) -> dict[str, Any]:
    """The config.json dict of the bundled model for a tokenizer of `vocab_size` tokens."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 2048,
        "num_nextn_predict_layers": 2,
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|eos|>"),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }


BUNDLED_CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "tiny-dsv3-mtp"
