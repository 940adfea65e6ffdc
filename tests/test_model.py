"""DeepSeek-V3 target and MTP against transformers, KV-pool decoding against full forwards, config errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding

from tiny_config import tiny_config
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.errors import CheckpointError
from triton_mtp.export.model import DeepseekV3MTP, DeepseekV3Target, group_weights

MAX_SLOTS, MAX_SEQ_LEN = 3, 24


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (norms around 1, a routing bias large enough to change selections)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def checkpoint_names(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict under the checkpoint's names (`experts.{e}.*_proj.weight`)."""
    return revert_weight_conversion(model, model.state_dict())


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(tiny_config())


@pytest.fixture(scope="module")
def hf_config() -> DeepseekV3Config:
    c = DeepseekV3Config(**tiny_config())
    c._attn_implementation = "eager"
    return c


@pytest.fixture(scope="module")
def hf_model(hf_config: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(hf_config).eval()
    randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def hf_with_mtp_layers(hf_config: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    """transformers' model with N + num_nextn_predict_layers layers; layers N.. are the MTP decoder layers."""
    n = hf_config.num_hidden_layers + hf_config.num_nextn_predict_layers
    c = DeepseekV3Config(**tiny_config() | {"num_hidden_layers": n})
    c._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(c).eval()
    randomize(model, seed=1)
    return model


@pytest.fixture(scope="module")
def target(config: ModelConfig, hf_model: DeepseekV3ForCausalLM) -> DeepseekV3Target:
    model = DeepseekV3Target(config, MAX_SLOTS, MAX_SEQ_LEN).eval()
    model.load_state_dict(checkpoint_names(hf_model), strict=True)
    return model


@pytest.fixture(scope="module")
def mtp(config: ModelConfig, target: DeepseekV3Target, hf_with_mtp_layers: DeepseekV3ForCausalLM) -> DeepseekV3MTP:
    """MTP decoder layers from transformers' layers N..; enorm, hnorm, eh_proj, shared_head.norm random."""
    model = DeepseekV3MTP(config, target, MAX_SLOTS, MAX_SEQ_LEN).eval()
    randomize(model.model, seed=2)
    decoder_weights = {k: v for k, v in checkpoint_names(hf_with_mtp_layers).items() if k in model.state_dict()}
    missing = model.load_state_dict(decoder_weights, strict=False).missing_keys
    assert {k.split(".", 3)[3] for k in missing} == {"enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                     "shared_head.norm.weight"}
    return model


@torch.no_grad()
def test_target_matches_transformers(target: DeepseekV3Target, hf_model: DeepseekV3ForCausalLM) -> None:
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))  # [B, T]
    out = hf_model.model(input_ids=tokens)
    ref_logits = hf_model.lm_head(out.last_hidden_state)  # [B, T, V]
    target.reset_cache()
    logits, hidden = target(tokens, torch.arange(12).expand(2, 12), torch.tensor([1, 0]))
    assert logits.dtype == torch.float32 and logits.shape == (2, 12, 128)
    assert rel_err(logits, ref_logits) <= 1e-4
    assert rel_err(hidden, out.last_hidden_state) <= 1e-4


@torch.no_grad()
def test_routing_bias_changes_the_output(target: DeepseekV3Target) -> None:
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))  # [1, T]
    positions, slots = torch.arange(12)[None], torch.tensor([0])
    target.reset_cache()
    with_bias = target(tokens, positions, slots)[0]
    bias = target.model.layers[1].mlp.gate.e_score_correction_bias
    saved = bias.clone()
    bias.zero_()
    target.reset_cache()
    without_bias = target(tokens, positions, slots)[0]
    bias.copy_(saved)
    assert rel_err(without_bias, with_bias) > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("layer", [0, 1])
def test_mtp_layer_matches_transformers_composition(
    layer: int,
    config: ModelConfig,
    hf_config: DeepseekV3Config,
    hf_with_mtp_layers: DeepseekV3ForCausalLM,
    mtp: DeepseekV3MTP,
    target: DeepseekV3Target,
) -> None:
    n = config.num_hidden_layers
    prefix = f"model.layers.{n + layer}."
    mine = {k[len(prefix):]: v for k, v in mtp.state_dict().items() if k.startswith(prefix)}
    decoder = hf_with_mtp_layers.model.layers[n + layer]

    def norm(weight: torch.Tensor) -> DeepseekV3RMSNorm:
        m = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        m.weight.copy_(weight)
        return m

    g = torch.Generator().manual_seed(3)
    B, T = 2, 9
    tokens = torch.randint(0, 128, (B, T), generator=g)  # [B, T]
    hidden = torch.randn(B, T, config.hidden_size, generator=g)  # [B, T, H]
    positions = torch.arange(T).expand(B, T)  # [B, T]
    embed = target.model.embed_tokens(tokens)  # [B, T, H]
    x = torch.cat([norm(mine["enorm.weight"])(embed), norm(mine["hnorm.weight"])(hidden)], dim=-1)  # [B, T, 2H]
    x = x @ mine["eh_proj.weight"].T  # [B, T, H]
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]  # [1, 1, T, T]
    cos_sin = DeepseekV3RotaryEmbedding(hf_config)(x, positions)
    x = decoder(x, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)  # [B, T, H]
    ref_hidden = norm(mine["shared_head.norm.weight"])(x)  # [B, T, H]
    ref_logits = target.lm_head(ref_hidden)  # [B, T, V]

    mtp.reset_cache()
    logits, hidden_out = mtp.layer_step(layer)(tokens, hidden, positions, torch.tensor([2, 1]))
    assert rel_err(logits, ref_logits) <= 1e-4
    assert rel_err(hidden_out, ref_hidden) <= 1e-4
    mtp.reset_cache()
    wrapped = mtp(tokens, hidden, positions, torch.tensor([2, 1]), layer + config.num_nextn_predict_layers)[0]
    assert rel_err(wrapped, ref_logits) <= 1e-4


# One call per line: (slot, first position, token count, wrong tokens?). A count of 0 is an all-padding row.
# Slot 2 takes 10 tokens; at position 5 it writes 3 wrong tokens (a rejected draft), then re-writes the right
# ones. Slot 0 takes 7 tokens and then rides along as padding.
SCHEDULE = [
    [(2, 0, 4, False), (0, 0, 6, False)],
    [(2, 4, 1, False), (0, 6, 1, False)],
    [(2, 5, 3, True), (0, 0, 0, False)],
    [(0, 0, 0, False), (2, 5, 2, False)],
    [(2, 7, 1, False), (0, 0, 0, False)],
    [(2, 8, 2, False), (0, 0, 0, False)],
]
LENGTHS = {2: 10, 0: 7}


def run_schedule(step, tokens: dict[int, torch.Tensor], hidden: dict[int, torch.Tensor] | None):
    """Feed SCHEDULE through `step`; return {(slot, position): logits[V]} for the right tokens."""
    seen = {}
    for call in SCHEDULE:
        T = max(n for _, _, n, _ in call)
        token_ids = torch.zeros(len(call), T, dtype=torch.long)  # [B, T]
        positions = torch.full((len(call), T), -1, dtype=torch.long)  # [B, T]
        rows_hidden = torch.randn(len(call), T, 64)  # [B, T, H]
        for b, (slot, start, n, wrong) in enumerate(call):
            right = tokens[slot][start:start + n]  # [n]
            token_ids[b, :n] = (right + 1) % 128 if wrong else right
            positions[b, :n] = torch.arange(start, start + n)
            if hidden is not None and not wrong:
                rows_hidden[b, :n] = hidden[slot][start:start + n]
        slot_ids = torch.tensor([slot for slot, *_ in call])  # [B]
        args = (token_ids, positions, slot_ids) if hidden is None else (token_ids, rows_hidden, positions, slot_ids)
        logits, out_hidden = step(*args)
        assert torch.isfinite(logits).all() and torch.isfinite(out_hidden).all()
        for b, (slot, start, n, wrong) in enumerate(call):
            for t in range(n):
                if not wrong:
                    seen[(slot, start + t)] = logits[b, t]
    return seen


def sequences(seed: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = {s: torch.randint(0, 128, (n,), generator=g) for s, n in LENGTHS.items()}
    hidden = {s: torch.randn(n, 64, generator=g) for s, n in LENGTHS.items()}
    return tokens, hidden


@torch.no_grad()
def test_target_incremental_decoding_equals_full_forward(target: DeepseekV3Target) -> None:
    tokens, _ = sequences(4)
    target.reset_cache()
    seen = run_schedule(target, tokens, None)
    assert len(seen) == sum(LENGTHS.values())
    for slot, n in LENGTHS.items():
        target.reset_cache()
        full = target(tokens[slot][None], torch.arange(n)[None], torch.tensor([1]))[0][0]  # [n, V]
        incremental = torch.stack([seen[(slot, p)] for p in range(n)])  # [n, V]
        assert rel_err(incremental, full) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_fused_input_projections_keep_the_outputs(q_lora_rank: int | None) -> None:
    """q_proj (q_a_proj) and kv_a_proj_with_mqa as one linear (the GPU build's load): the target's and the MTP's
    logits stay within float32 rounding, the two names are gone, and fusing again does nothing."""
    config = ModelConfig.from_dict(tiny_config() | {"q_lora_rank": q_lora_rank})
    target = DeepseekV3Target(config, MAX_SLOTS, MAX_SEQ_LEN).eval()
    mtp = DeepseekV3MTP(config, target, MAX_SLOTS, MAX_SEQ_LEN).eval()
    randomize(target, seed=3)
    randomize(mtp.model, seed=4)
    tokens, positions, slots = torch.randint(0, 128, (2, 5)), torch.arange(5).expand(2, 5), torch.tensor([0, 2])

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        target.reset_cache()
        mtp.reset_cache()
        logits, hidden = target(tokens, positions, slots)  # [B, T, V], [B, T, H]
        return logits, mtp(tokens, hidden, positions, slots, 1)[0]

    before = outputs()
    group_weights(target, mtp)
    attention = target.model.layers[0].self_attn
    for model in (target, mtp):
        names = {name.rsplit(".", 2)[-2] for name, _ in model.named_parameters()}
        assert "fused_qkv_a_proj" in names and not names & {"q_proj", "q_a_proj", "kv_a_proj_with_mqa"}
    fused = attention.fused_qkv_a_proj.weight
    group_weights(target)
    assert attention.fused_qkv_a_proj.weight is fused
    for got, expected in zip(outputs(), before):
        assert rel_err(got, expected) <= 1e-6


@torch.no_grad()
def test_mtp_incremental_decoding_equals_full_forward(mtp: DeepseekV3MTP) -> None:
    tokens, hidden = sequences(5)
    step = mtp.layer_step(1)
    step.reset_cache()
    seen = run_schedule(step, tokens, hidden)
    for slot, n in LENGTHS.items():
        step.reset_cache()
        full = step(tokens[slot][None], hidden[slot][None], torch.arange(n)[None], torch.tensor([1]))[0][0]  # [n, V]
        incremental = torch.stack([seen[(slot, p)] for p in range(n)])  # [n, V]
        assert rel_err(incremental, full) <= 1e-4


@torch.no_grad()
def test_compiled_mtp_layer_steps_share_one_graph_and_keep_their_own_pool_layer(mtp: DeepseekV3MTP) -> None:
    """The layer steps differ only in their module and pool-layer tensor, so `torch.compile` (dynamic shapes, as
    served) traces each size class once for every layer; each layer still computes its own outputs and writes only
    its own layer of the pool."""
    layers = mtp.config.num_nextn_predict_layers
    assert layers >= 2
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    steps = [torch.compile(mtp.layer_step(k), dynamic=True, backend=backend) for k in range(layers)]
    tokens, hidden = sequences(7)
    try:
        for k, step in enumerate(steps):
            for B, T in ((2, 3), (1, 1)):
                ids, h = tokens[2][:T].expand(B, T), hidden[2][:T].expand(B, T, -1)  # [B, T], [B, T, H]
                positions, slots = torch.arange(T).expand(B, T), torch.arange(B)  # [B, T], [B]
                mtp.reset_cache()
                expected = mtp(ids, h, positions, slots, k)
                written = mtp.kv_cache.clone()
                mtp.reset_cache()
                got = step(ids, h, positions, slots)
                assert all(rel_err(g, e) <= 1e-5 for g, e in zip(got, expected)), (k, B, T)
                assert torch.equal(mtp.kv_cache, written), (k, B, T)
                others = [i for i in range(layers) if i != k]
                assert mtp.kv_cache[k].any() and not mtp.kv_cache[others].any(), (k, B, T)
    finally:
        torch._dynamo.reset()
        mtp.reset_cache()
    assert len(graphs) == 2  # (2, 3) and (1, 1): sizes of 1 specialize; the layers add none


def test_mtp_state_dict_is_exactly_its_own_layers(
    config: ModelConfig, target: DeepseekV3Target, mtp: DeepseekV3MTP
) -> None:
    keys = list(mtp.state_dict())
    assert keys and all(k.startswith(("model.layers.3.", "model.layers.4.")) for k in keys)
    assert "model.layers.3.enorm.weight" in keys and "model.layers.4.shared_head.norm.weight" in keys
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in keys)
    assert mtp.embed_tokens.weight is target.model.embed_tokens.weight
    assert mtp.head.weight is target.lm_head.weight
    fresh = DeepseekV3MTP(config, target, 1, 8)
    fresh.load_state_dict(mtp.state_dict(), strict=True)
    with pytest.raises(RuntimeError, match="model.layers.4.eh_proj.weight"):
        fresh.load_state_dict({k: v for k, v in mtp.state_dict().items() if "4.eh_proj" not in k}, strict=True)


@torch.no_grad()
def test_bfloat16_weights_still_return_float32_logits(config: ModelConfig, target: DeepseekV3Target) -> None:
    tokens = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(6))  # [1, T]
    positions, slots = torch.arange(8)[None], torch.tensor([0])
    target.reset_cache()
    ref = target(tokens, positions, slots)[0]
    half = DeepseekV3Target(config, 1, 8)
    half.load_state_dict(target.state_dict())
    half.to(torch.bfloat16)
    logits, hidden = half(tokens, positions, slots)
    assert half.kv_cache.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16
    assert logits.dtype == torch.float32
    assert rel_err(logits, ref) <= 0.1


def test_config_round_trips_through_to_dict(config: ModelConfig) -> None:
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.q_lora_rank == 48 and config.rope_scaling["mscale_all_dim"] == 0.7


def test_config_rejects_other_model_types() -> None:
    d = tiny_config() | {"model_type": "llama"}
    message = r"^ckpt/config.json: unsupported model_type 'llama' \(expected 'deepseek_v3'\)$"
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_dict(d, source="ckpt/config.json")


def test_config_names_a_missing_key(tmp_path) -> None:
    d = tiny_config()
    del d["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"config.json: missing required key 'kv_lora_rank'"):
        ModelConfig.from_checkpoint(tmp_path)


def test_config_rejects_other_routing() -> None:
    with pytest.raises(CheckpointError, match="topk_method 'greedy'"):
        ModelConfig.from_dict(tiny_config() | {"topk_method": "greedy"})
