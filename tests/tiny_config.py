"""A tiny DeepSeek-V3 config.json dict that turns every model feature on, and a tokenizer for its
vocabulary, shared by the tests."""

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers


def tiny_config() -> dict[str, Any]:
    """q-LoRA, grouped noaux_tc MoE with a shared expert, YaRN RoPE, two MTP layers."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "float32",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
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
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 128,
        "num_nextn_predict_layers": 2,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "attention_bias": False,
        "initializer_range": 0.02,
    }


def word_tokenizer(path: Path) -> None:
    """tokenizer.json whose token i is the word `t<i>`, so text and ids translate by eye."""
    vocab = tiny_config()["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
