"""Exported steps (torchscript, onnx, eager, aoti) behave like the eager model, KV pool included.

Each format is exported once per module from the tiny config. AOTInductor compiles C++ for a
minute on a small CPU, so its case runs a smaller model and carries the `aoti` mark.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tiny_config import tiny_config
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.graphs import ParityError, check_parity, export_graphs, load_step
from triton_mtp.export.model import DeepseekV3MTP, DeepseekV3Target
from triton_mtp.export.synthetic import write_checkpoint

MAX_SLOTS, MAX_SEQ_LEN = 3, 24


def build_models(
    directory: Path, overrides: dict | None = None, seed: int = 0
) -> tuple[DeepseekV3Target, DeepseekV3MTP]:
    """Write a random checkpoint of the tiny config into `directory` and load target and MTP from it."""
    write_checkpoint(directory, {**tiny_config(), **(overrides or {})}, seed=seed)
    _, target, mtp = load_checkpoint(directory, "fp32", "cpu", MAX_SLOTS, MAX_SEQ_LEN, progress=False)
    return target, mtp


# A prefill chunk of two rows in slots 2 and 0 (row 1 has 3 valid tokens, then padding), then a
# verify window of 3 tokens and a one-token decode step that must see everything written before.
PREFILL_POSITIONS = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]])
VERIFY_POSITIONS = torch.tensor([[5, 6, 7], [3, 4, 5]])
DECODE_POSITIONS = torch.tensor([[8], [6]])
SLOT_IDS = torch.tensor([2, 0])


def random_token_ids(positions: torch.Tensor, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, tuple(positions.shape), generator=torch.Generator().manual_seed(seed))


def assert_valid_close(got: torch.Tensor, expected: torch.Tensor, positions: torch.Tensor) -> None:
    valid = positions >= 0  # [B, T]
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-4, atol=1e-5)


FORMAT_PARAMS = ["torchscript", "onnx", "eager", pytest.param("aoti", marks=pytest.mark.aoti)]


@pytest.fixture(scope="module", params=FORMAT_PARAMS)
def exported(request, tmp_path_factory):
    """(fmt, target, mtp, artifacts): one export per format for the whole module.

    The eager artifacts are loaded without torch.compile (minutes of C++ compilation on CPU).
    """
    fmt = request.param
    overrides = {"num_hidden_layers": 2, "num_nextn_predict_layers": 1} if fmt == "aoti" else None
    checkpoint = tmp_path_factory.mktemp(f"checkpoint_{fmt}")
    target, mtp = build_models(checkpoint, overrides)
    out = tmp_path_factory.mktemp(f"graphs_{fmt}")
    artifacts = export_graphs(target, mtp, out, fmt, checkpoint_dir=checkpoint, dtype="fp32", eager_compile=False)
    yield fmt, target, mtp, artifacts
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(checkpoint, ignore_errors=True)


def test_export_writes_one_file_per_step(exported):
    fmt, _, mtp, artifacts = exported
    n = mtp.config.num_nextn_predict_layers
    assert sorted(artifacts) == sorted(["target", *(f"mtp_{i}" for i in range(n))])
    assert all(path.is_file() and path.stat().st_size > 0 for path in artifacts.values())


def test_target_matches_eager_over_prefill_verify_decode(exported):
    fmt, target, _, artifacts = exported
    runner = load_step(artifacts["target"], fmt, "cpu")
    target.reset_cache()
    vocab = target.config.vocab_size
    with torch.no_grad():
        for seed, positions in enumerate((PREFILL_POSITIONS, VERIFY_POSITIONS, DECODE_POSITIONS)):
            token_ids = random_token_ids(positions, vocab, seed)
            logits, hidden = runner(token_ids, positions, SLOT_IDS)
            ref_logits, ref_hidden = target(token_ids, positions, SLOT_IDS)
            assert logits.dtype == torch.float32 and logits.shape == (*positions.shape, vocab)
            assert_valid_close(logits, ref_logits, positions)
            assert_valid_close(hidden, ref_hidden, positions)
        torch.testing.assert_close(runner.kv_cache[:, :, :-1], target.kv_cache[:, :, :-1], rtol=1e-4, atol=1e-5)
    target.reset_cache()


def test_target_decode_depends_on_pool_and_reset_forgets_it(exported):
    fmt, target, _, artifacts = exported
    runner = load_step(artifacts["target"], fmt, "cpu")
    vocab = target.config.vocab_size
    prefill_ids = random_token_ids(PREFILL_POSITIONS, vocab, 0)
    decode_ids = random_token_ids(DECODE_POSITIONS, vocab, 1)
    decode_positions = torch.tensor([[5], [3]])
    runner(prefill_ids, PREFILL_POSITIONS, SLOT_IDS)
    after_prefill, _ = runner(decode_ids, decode_positions, SLOT_IDS)
    runner.reset_cache()
    assert not runner.kv_cache.any()
    on_empty_pool, _ = runner(decode_ids, decode_positions, SLOT_IDS)
    assert (after_prefill - on_empty_pool).abs().max() > 1e-3
    runner.reset_cache()
    runner(prefill_ids, PREFILL_POSITIONS, SLOT_IDS)
    again, _ = runner(decode_ids, decode_positions, SLOT_IDS)
    torch.testing.assert_close(again, after_prefill)


def test_target_batch_of_one_reads_only_its_slot(exported):
    fmt, target, _, artifacts = exported
    runner = load_step(artifacts["target"], fmt, "cpu")
    vocab = target.config.vocab_size
    prefill_ids = random_token_ids(PREFILL_POSITIONS, vocab, 0)
    runner(prefill_ids, PREFILL_POSITIONS, SLOT_IDS)
    decode_ids = random_token_ids(DECODE_POSITIONS, vocab, 1)[1:]  # [1, 1]
    alone, _ = runner(decode_ids, torch.tensor([[3]]), SLOT_IDS[1:])
    target.reset_cache()
    with torch.no_grad():
        target(prefill_ids[1:, :3], PREFILL_POSITIONS[1:, :3], SLOT_IDS[1:])
        expected, _ = target(decode_ids, torch.tensor([[3]]), SLOT_IDS[1:])
    target.reset_cache()
    torch.testing.assert_close(alone, expected, rtol=1e-4, atol=1e-5)


def test_mtp_layers_share_one_pool_and_cycle(exported):
    fmt, target, mtp, artifacts = exported
    runner = load_step(artifacts["mtp_0"], fmt, "cpu")
    n = mtp.config.num_nextn_predict_layers
    H, vocab = mtp.config.hidden_size, mtp.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    mtp.reset_cache()
    with torch.no_grad():
        for layer, positions in enumerate((PREFILL_POSITIONS, VERIFY_POSITIONS, DECODE_POSITIONS, DECODE_POSITIONS + 1)):
            token_ids = random_token_ids(positions, vocab, 10 + layer)
            hidden = torch.randn(*positions.shape, H, generator=gen)  # [B, T, H]
            logits, hidden_out = runner(token_ids, hidden, positions, SLOT_IDS, layer=layer)
            ref_logits, ref_hidden = mtp(token_ids, hidden, positions, SLOT_IDS, layer)
            assert_valid_close(logits, ref_logits, positions)
            assert_valid_close(hidden_out, ref_hidden, positions)
        assert runner.kv_cache.shape[0] == n
        torch.testing.assert_close(runner.kv_cache[:, :, :-1], mtp.kv_cache[:, :, :-1], rtol=1e-4, atol=1e-5)
    mtp.reset_cache()


def test_check_parity_passes_for_a_faithful_export(exported, capsys):
    fmt, target, mtp, artifacts = exported
    errors = check_parity(target, mtp, artifacts, fmt, verify_tokens=3)
    assert set(errors) == set(artifacts)
    assert all(0 <= e < 1e-4 for e in errors.values())
    assert "parity target." in capsys.readouterr().out


def test_check_parity_fails_with_numbers_for_a_broken_artifact(tmp_path):
    target, mtp = build_models(tmp_path / "checkpoint")
    artifacts = export_graphs(target, mtp, tmp_path, "torchscript")
    broken, _ = build_models(tmp_path / "checkpoint")
    with torch.no_grad():
        broken.model.layers[1].mlp.shared_experts.down_proj.weight.mul_(1.5)
    export_graphs(broken, None, tmp_path, "torchscript")  # overwrites target.pt only
    with pytest.raises(ParityError, match=r"target\.pt max relative error \d\.\d+e[-+]\d+ .*logits \d"):
        check_parity(target, mtp, artifacts, "torchscript", log=lambda line: None)


def test_load_step_rejects_bad_format_and_missing_artifact(tmp_path):
    with pytest.raises(ValueError, match="format: unknown format 'tensorrt'"):
        load_step(tmp_path, "tensorrt", "cpu")
    with pytest.raises(FileNotFoundError, match=r"target\.pt: no torchscript artifact"):
        load_step(tmp_path, "torchscript", "cpu")


def test_onnx_rejects_bf16_by_name(tmp_path):
    target, _ = build_models(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="format onnx: dtype bfloat16 is not supported"):
        export_graphs(target.to(torch.bfloat16), None, tmp_path, "onnx")



@pytest.mark.parametrize("value, message", [('["linear", "flash"]', "decode_kernels: unknown flash"),
                                            ('"linear"', "'decode_kernels' must be a list of names")])
def test_eager_reference_with_bad_decode_kernels_is_named(tmp_path, value, message):
    reference = {"checkpoint": str(tmp_path), "dtype": "fp32", "max_slots": 1, "max_seq_len": 8, "step": "target",
                 "layer": None, "compile": False}
    (tmp_path / "target.json").write_text(json.dumps(reference)[:-1] + f', "decode_kernels": {value}}}')
    with pytest.raises(ValueError, match=re.escape(f"target.json: key {message}")):
        load_step(tmp_path, "eager", "cpu")


def test_eager_reference_without_checkpoint_key_is_named(tmp_path):
    (tmp_path / "target.json").write_text('{"dtype": "fp32"}')
    with pytest.raises(ValueError, match=r"target\.json: missing key 'checkpoint'"):
        load_step(tmp_path, "eager", "cpu")
