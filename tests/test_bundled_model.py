"""The bundled checkpoint (models/tiny-dsv3-mtp): a real Hugging Face DeepSeek-V3 checkpoint with two
trained MTP layers, whose drafts the engine accepts on held-out code."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.serving.requests import TokenizerFile
from triton_mtp.train.acceptance import evaluate, held_out_prompts
from triton_mtp.train.config import BUNDLED_CHECKPOINT

K1_ACCEPTANCE_FLOOR = 0.6


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((BUNDLED_CHECKPOINT / "config.json").read_text())


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return held_out_prompts(TokenizerFile(BUNDLED_CHECKPOINT / "tokenizer.json"), 1, 64)[0]


def test_checkpoint_has_every_feature_and_both_mtp_layers_within_16_mb(config):
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 2
    assert config["q_lora_rank"] and config["n_routed_experts"] > 1 and config["n_shared_experts"] >= 1
    assert config["topk_method"] == "noaux_tc" and config["first_k_dense_replace"] == 1
    assert config["rope_scaling"]["type"] == "yarn"
    assert (BUNDLED_CHECKPOINT / "model.safetensors").stat().st_size <= 16 * 10**6
    n = config["num_hidden_layers"]
    with safe_open(BUNDLED_CHECKPOINT / "model.safetensors", "pt") as f:
        names = set(f.keys())
        bias = f.get_tensor(f"model.layers.{n}.mlp.gate.e_score_correction_bias")
    for layer in (n, n + 1):
        for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "mlp.experts.0.gate_proj",
                     "mlp.shared_experts.down_proj", "self_attn.q_a_proj"):
            assert f"model.layers.{layer}.{part}.weight" in names
    assert bias.abs().max() > 0  # load balancing moved the routing bias


def test_both_tokenizer_loaders_agree():
    text = "def area(r):\n    return 3.14159 * r ** 2\n"
    ids = Tokenizer.from_file(str(BUNDLED_CHECKPOINT / "tokenizer.json")).encode(text).ids
    assert AutoTokenizer.from_pretrained(BUNDLED_CHECKPOINT)(text).input_ids == ids
    assert TokenizerFile(BUNDLED_CHECKPOINT / "tokenizer.json").decode(ids) == text


def test_transformers_greedy_continuation_equals_our_target(prompt):
    hf = DeepseekV3ForCausalLM.from_pretrained(BUNDLED_CHECKPOINT, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    _, target, _ = load_checkpoint(BUNDLED_CHECKPOINT, max_slots=1, max_seq_len=128, progress=False)
    slot, ids = torch.tensor([0]), list(prompt)
    with torch.no_grad():
        logits, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], slot)
        while len(ids) < len(prompt) + len(expected):
            ids.append(int(logits[0, -1].argmax()))
            logits, _ = target(torch.tensor([ids[-1:]]), torch.tensor([[len(ids) - 1]]), slot)
    assert ids[len(prompt):] == expected


def test_engine_accepts_first_drafts_above_the_floor_on_held_out_code():
    prompts = held_out_prompts(TokenizerFile(BUNDLED_CHECKPOINT / "tokenizer.json"), 8, 128)
    result = evaluate(BUNDLED_CHECKPOINT, prompts, max_tokens=48, num_draft_tokens=4)
    assert result.per_position[0] >= K1_ACCEPTANCE_FLOOR
    assert result.per_position == sorted(result.per_position, reverse=True)
    assert result.mean_accepted_length == pytest.approx(1 + sum(result.per_position))
