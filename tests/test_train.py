"""Training of the bundled model on CPU: the corpus split, the objective's alignment, a few real steps,
that what training computes is what the served target and MTP compute from the saved checkpoint, and
phase 2 (MTP self-distillation): it trains the MTP layers on what serving feeds them, target untouched."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, DeepseekV3Config

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.train.config import bundled_model_config
from triton_mtp.train.corpus import is_held_out, split_stdlib
from triton_mtp.train.distill import DistillSettings, distill, load_training_model, serving_forward
from triton_mtp.train.loop import TrainSettings, Trainer, prepare_corpus, train
from triton_mtp.train.objective import TrainingModel, mtp_lambda, objective
from triton_mtp.train.tokenizer import save_tokenizer

SMOKE = TrainSettings(steps=8, batch_size=4, seq_len=48, lr=3e-3, warmup_steps=2, vocab_size=600,
                      eval_every=4, eval_windows=4, log_every=1, max_files=6)


@pytest.fixture(scope="module")
def corpus():
    return prepare_corpus(SMOKE)


def small_model(vocab_size: int) -> TrainingModel:
    """The bundled architecture (every feature on) at a width that runs in milliseconds."""
    d = bundled_model_config(vocab_size)
    d.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, q_lora_rank=32, kv_lora_rank=16)
    torch.manual_seed(0)
    return TrainingModel(DeepseekV3Config(**d)).eval()


def test_split_is_a_deterministic_path_rule_that_holds_out_at_least_5_percent():
    split = split_stdlib()
    assert split == split_stdlib()
    assert not set(split.train) & set(split.held_out)
    assert len(split.held_out) >= 0.05 * (len(split.train) + len(split.held_out))
    assert all(is_held_out(p) for p in split.held_out) and not any(is_held_out(p) for p in split.train)
    for path in split.train + split.held_out:
        parts = Path(path).parts[:-1]
        assert not {"test", "tests", "site-packages"} & set(parts), path


def test_tokenizer_is_byte_level_and_loads_in_transformers(corpus, tmp_path):
    source = corpus.split.read(corpus.split.held_out[0])
    ids = corpus.tokenizer.encode(source).ids
    assert ids[0] == 0  # <|bos|>
    assert corpus.tokenizer.decode(ids) == source  # lossless on unseen code
    save_tokenizer(corpus.tokenizer, tmp_path, 512)
    assert AutoTokenizer.from_pretrained(tmp_path)(source).input_ids == ids


def test_mtp_depth_k_row_i_sees_tokens_up_to_i_plus_k_only():
    model = small_model(64)
    tokens = torch.randint(2, 64, (1, 12))
    changed = tokens.clone()
    changed[0, 7] = (tokens[0, 7] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    for k, (a, b) in enumerate(zip(before, after)):  # k = 0 is the target
        same = (a - b).abs().amax(-1)[0] < 1e-6  # per row
        rows = torch.arange(a.shape[1])
        assert torch.equal(same, rows + k < 7), f"depth {k}"


def test_objective_is_next_token_loss_plus_scheduled_mean_mtp_loss():
    losses = [torch.tensor(2.0), torch.tensor(3.0), torch.tensor(5.0)]
    assert [mtp_lambda(s, 100) for s in (0, 69, 70, 99)] == [0.3, 0.3, 0.1, 0.1]
    assert objective(losses, mtp_lambda(0, 100)).item() == pytest.approx(2.0 + 0.3 * 4.0)


def test_few_cpu_steps_lower_the_loss_and_repeat_exactly_from_the_seed(corpus, tmp_path):
    first = train(SMOKE, corpus, tmp_path / "a", "cpu", log=lambda _: None)
    again = train(SMOKE, corpus, tmp_path / "b", "cpu", log=lambda _: None)
    other = train(dataclasses.replace(SMOKE, seed=1), corpus, tmp_path / "c", "cpu", log=lambda _: None)

    def steps(out: Path) -> list[dict]:
        return [e for e in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "loss" in e]

    losses = [e["loss"] for e in steps(tmp_path / "a")]
    assert len(losses) == SMOKE.steps
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.5
    assert first["final"]["held_out_loss"][0] < 6.0  # ln(600) = 6.4 at random init
    assert [e["loss"] for e in steps(tmp_path / "b")] == losses
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert [e["loss"] for e in steps(tmp_path / "c")] != losses
    assert again["final"] == first["final"] != other["final"]


def test_saved_checkpoint_serves_what_training_computes(corpus, tmp_path):
    trainer = Trainer(dataclasses.replace(SMOKE, steps=2), corpus, "cpu")
    for _ in range(2):
        trainer.step()
    trainer.save(tmp_path)
    with torch.no_grad():  # the weights as the checkpoint stores them
        for name, p in trainer.model.named_parameters():
            if not name.endswith("mlp.gate.weight"):
                p.copy_(p.bfloat16().float())
    config, target, mtp = load_checkpoint(tmp_path, max_slots=1, max_seq_len=32, progress=False)
    tokens = corpus.train_ids[:20].unsqueeze(0)  # 1, L
    L, slot = tokens.shape[1], torch.tensor([0])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(tokens)  # [target, MTP 1, MTP 2]
        logits, hidden = target(tokens, torch.arange(L)[None], slot)
        torch.testing.assert_close(logits, expected[0], atol=2e-4, rtol=1e-4)
        for k in (1, 2):  # depth k: rows pair h^{k-1}_i with token i+k
            n = L - k  # training places row i at position i + k - 1; RoPE is relative, so 0..n-1 here is
            # the same attention without the unwritten cache positions below k - 1
            logits, hidden = mtp(tokens[:, k:], hidden[:, :n], torch.arange(n)[None], slot, k - 1)
            torch.testing.assert_close(logits, expected[k], atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def phase1_checkpoint(corpus, tmp_path_factory) -> Path:
    trainer = Trainer(dataclasses.replace(SMOKE, steps=2), corpus, "cpu")
    for _ in range(2):
        trainer.step()
    out = tmp_path_factory.mktemp("phase1")
    trainer.save(out)
    return out


def test_phase2_lowers_the_distillation_loss_and_leaves_the_target_bit_for_bit(corpus, phase1_checkpoint, tmp_path):
    settings = DistillSettings(steps=6, batch_size=4, seq_len=48, lr=3e-3, warmup_steps=1, eval_every=100,
                               eval_windows=4, log_every=1, max_files=SMOKE.max_files)
    summary = distill(settings, corpus, phase1_checkpoint, tmp_path, "cpu", log=lambda _: None)
    initial, final = summary["initial"]["held_out_kl"], summary["final"]["held_out_kl"]
    assert len(final) == 2 and sum(final) < sum(initial) - 0.05, (initial, final)
    before = load_file(phase1_checkpoint / "model.safetensors")
    after = load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys()
    n = DeepseekV3Config.from_pretrained(phase1_checkpoint).num_hidden_layers
    mtp_prefix = tuple(f"model.layers.{n + i}." for i in range(2))
    for name, tensor in before.items():
        if name.startswith(mtp_prefix):
            continue
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    changed = [k for k in before if k.startswith(mtp_prefix) and not torch.equal(before[k], after[k])]
    assert any(".eh_proj." in k for k in changed) and any(".self_attn." in k for k in changed)


def test_phase2_trains_each_mtp_layer_on_the_pairs_serving_gives_it(corpus, phase1_checkpoint):
    model = load_training_model(phase1_checkpoint).eval()
    _, target, mtp = load_checkpoint(phase1_checkpoint, dtype=torch.float32, max_slots=1, max_seq_len=32,
                                          progress=False)
    tokens = corpus.train_ids[:20].unsqueeze(0)  # 1, L
    L, slot = tokens.shape[1], torch.tensor([0])
    with torch.no_grad():
        target_logits, (depth1, depth2) = serving_forward(model, tokens)
        _, hidden = target(tokens, torch.arange(L)[None], slot)  # 1, L, H
        for base in (3, 11):  # DraftWorker: prefill writes target pairs into both layers, layer 0 drafts ...
            for layer in (1, 0):
                logits, out = mtp(tokens[:, 1:base + 2], hidden[:, :base + 1], torch.arange(base + 1)[None],
                                  slot, layer)
            torch.testing.assert_close(logits[0, -1], depth1[0, base], atol=2e-4, rtol=1e-4)
            # ... then layer 1 takes (draft 1, layer 0's hidden) at position base + 1 over that cache
            logits, _ = mtp(tokens[:, base + 2:base + 3], out[:, -1:], torch.tensor([[base + 1]]), slot, 1)
            torch.testing.assert_close(logits[0, -1], depth2[0, base], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("argv, named", [
    (["train", "--out", "OUT", "--corpus-root", "/no/such/lib"], "/no/such/lib"),
    (["train", "--out", "OUT", "--vocab-size", "100"], "--vocab-size"),
    (["train", "--out", "OUT", "--steps", "0"], "--steps"),
    (["eval-acceptance", "--checkpoint", "/no/such/ckpt"], "/no/such/ckpt/tokenizer.json"),
    (["train", "--out", "OUT", "--distill-from", "/no/such/ckpt"], "/no/such/ckpt/config.json"),
    (["train", "--out", "OUT", "--ce-weight", "0.5"], "--ce-weight"),
])
def test_bad_input_is_a_one_line_error_naming_the_field(argv, named, tmp_path):
    from triton_mtp.cli import main
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path) if a == "OUT" else a for a in argv])
    message = str(exc.value)
    assert named in message and "\n" not in message
