"""Checkpoint loading: synthetic DeepSeek-V3 checkpoints (FP8, sharded, single file) and every bad one."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from triton_mtp.export.checkpoint import load_checkpoint, resolve_dtype
from triton_mtp.export.errors import CheckpointError
from triton_mtp.export.synthetic import random_weights, write_checkpoint
from tiny_config import tiny_config

SEED = 3
BLOCK = [16, 16]  # several blocks per tiny matrix, with padded edges (e.g. kv_a_proj_with_mqa is 40 x 64)
N = tiny_config()["num_hidden_layers"]


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("fp32"), tiny_config(), seed=SEED)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = {**tiny_config(), "quantization_config": {"quant_method": "fp8", "weight_block_size": BLOCK}}
    return write_checkpoint(tmp_path_factory.mktemp("fp8"), cfg, seed=SEED, shards=3, fp8=True, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def reference(fp32_dir: Path):
    return load_checkpoint(fp32_dir, progress=False)


def _inputs(T: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    token_ids = torch.randint(0, tiny_config()["vocab_size"], (2, T), generator=torch.Generator().manual_seed(0))  # [2, T]
    positions = torch.arange(T).repeat(2, 1)  # [2, T]
    return token_ids, positions, torch.tensor([0, 1])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _state(target, mtp) -> dict[str, torch.Tensor]:
    return {**target.state_dict(), **(mtp.state_dict() if mtp is not None else {})}


def test_sharded_fp8_checkpoint_matches_its_unquantized_twin(fp8_dir: Path, reference) -> None:
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    with safe_open(fp8_dir / index["weight_map"][name], "pt") as f:
        assert f.get_slice(name).get_dtype() == "F8_E4M3"
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["weight_block_size"] == BLOCK

    config, target, mtp = load_checkpoint(fp8_dir, progress=False)
    _, ref_target, ref_mtp = reference
    assert config.num_nextn_predict_layers == 2 and mtp is not None

    loaded, twin = _state(target, mtp), _state(ref_target, ref_mtp)
    assert loaded.keys() == twin.keys()
    for key, want in twin.items():
        # e4m3 keeps 3 mantissa bits: within 1/16 of the tensor's largest magnitude
        assert (loaded[key] - want).abs().max() <= want.abs().max() / 16, key
    assert not torch.equal(loaded["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
                           twin["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])

    token_ids, positions, slots = _inputs()
    logits, hidden = target(token_ids, positions, slots)  # [2, T, V], [2, T, H]
    ref_logits, ref_hidden = ref_target(token_ids, positions, slots)
    assert _rel_err(logits, ref_logits) < 0.1
    for layer in range(2):
        mtp_logits, _ = mtp(token_ids, hidden, positions, slots, layer)  # [2, T, V]
        ref_mtp_logits, _ = ref_mtp(token_ids, ref_hidden, positions, slots, layer)
        assert _rel_err(mtp_logits, ref_mtp_logits) < 0.1


def test_single_file_fp32_loads_exactly(fp32_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in fp32_dir.iterdir()) == ["config.json", "model.safetensors"]
    config, target, mtp = load_checkpoint(fp32_dir, dtype="fp32")
    assert "loading" in capsys.readouterr().err
    weights = random_weights(tiny_config(), seed=SEED)
    loaded = _state(target, mtp)
    assert all(torch.equal(loaded[k], weights[k]) for k in loaded)
    # everything but the MTP layers' copies of the shared embedding and head
    assert set(weights) - set(loaded) == {f"model.layers.{N + i}.{s}" for i in range(2)
                                          for s in ("embed_tokens.weight", "shared_head.head.weight")}
    assert mtp.embed_tokens.weight is target.model.embed_tokens.weight
    assert target.kv_cache.shape[2] == config.max_position_embeddings + 1


def test_bf16_load(fp32_dir: Path, reference) -> None:
    _, target, mtp = load_checkpoint(fp32_dir, dtype="bf16", max_slots=2, max_seq_len=16, progress=False)
    assert {p.dtype for p in [*target.parameters(), *mtp.parameters()]} == {torch.bfloat16}
    assert target.kv_cache.shape[1:3] == (2, 17)
    token_ids, positions, slots = _inputs()
    logits, _ = target(token_ids, positions, slots)
    assert _rel_err(logits, reference[1](token_ids, positions, slots)[0]) < 0.05


def test_dtype_names() -> None:
    assert [resolve_dtype(d) for d in ("float16", "torch.bfloat16", torch.float32)] == [
        torch.float16, torch.bfloat16, torch.float32]
    with pytest.raises(ValueError, match="^dtype: unsupported 'int8'"):
        resolve_dtype("int8")


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _edit_in_shard(ck: Path, name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace one tensor of a sharded checkpoint by `edit(tensor)`."""
    shard = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"][name]
    _edit_tensors(ck / shard, lambda t: t.update({name: edit(t[name])}))


def _drop_from_shard(ck: Path, names: list[str]) -> None:
    """Remove tensors from a sharded checkpoint, index included."""
    index = ck / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    for name in names:
        _edit_tensors(ck / weight_map[name], lambda t, n=name: t.pop(n))
    _edit_json(index, lambda d: [d["weight_map"].pop(n) for n in names])


SCALE = "model.layers.2.self_attn.o_proj.weight_scale_inv"


def _misplace_scale(ck: Path) -> None:
    """Make the index name a shard that does not hold SCALE."""
    def edit(d: dict) -> None:
        d["weight_map"][SCALE] = next(f for f in sorted(set(d["weight_map"].values())) if f != d["weight_map"][SCALE])
    _edit_json(ck / "model.safetensors.index.json", edit)

BAD_SINGLE = {
    "missing config.json": (lambda ck: (ck / "config.json").unlink(), r"config\.json: file not found"),
    "missing key": (lambda ck: _edit_json(ck / "config.json", lambda d: d.pop("hidden_size")),
                    r"config\.json: missing required key 'hidden_size'"),
    "model_type": (lambda ck: _edit_json(ck / "config.json", lambda d: d.update(model_type="llama")),
                   r"config\.json: unsupported model_type 'llama'"),
    "missing tensors": (
        lambda ck: _edit_tensors(ck / "model.safetensors", lambda t: [t.pop(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
                                                                      for e in range(5)]),
        r"missing tensors model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight, model\.layers\.1\.mlp\.experts\.1\.up_proj"
        r"\.weight, model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight \(and 2 more\)"),
    "partial MTP": (
        lambda ck: _edit_tensors(ck / "model.safetensors", lambda t: [t.pop(k) for k in list(t) if k.startswith(f"model.layers.{N + 1}.")]),
        rf"missing tensors model\.layers\.{N + 1}\."),
    "unexpected tensor": (
        lambda ck: _edit_tensors(ck / "model.safetensors", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})),
        r"model\.safetensors: unexpected tensors model\.layers\.0\.mlp\.extra\.weight$"),
    "shape mismatch": (
        lambda ck: _edit_tensors(ck / "model.safetensors", lambda t: t.update({"model.norm.weight": torch.ones(65)})),
        r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[65\], expected \[64\]"),
    "MTP head differs": (
        lambda ck: _edit_tensors(ck / "model.safetensors", lambda t: t[f"model.layers.{N}.shared_head.head.weight"].mul_(2)),
        rf"model\.safetensors: tensor 'model\.layers\.{N}\.shared_head\.head\.weight' differs from 'lm_head\.weight'"),
    "truncated file": (
        lambda ck: (ck / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes()[:5000]),
        r"model\.safetensors: unreadable safetensors file \(.*\)$"),
    "bad header": (
        lambda ck: (ck / "model.safetensors").write_bytes(b"\x20" + b"\x00" * 7 + b"{not json" + b" " * 40),
        r"model\.safetensors: unreadable safetensors file \(.*header.*\)$"),
    "no weights": (lambda ck: (ck / "model.safetensors").unlink(), r": no model\.safetensors or model\.safetensors\.index\.json found"),
}

BAD_SHARDED = {
    "scale missing": (lambda ck: _drop_from_shard(ck, [SCALE]),
                      r"model-0000\d-of-00003\.safetensors: FP8 tensor 'model\.layers\.2\.self_attn\.o_proj\.weight' "
                      r"has no 'model\.layers\.2\.self_attn\.o_proj\.weight_scale_inv'"),
    "scale shape": (lambda ck: _edit_in_shard(ck, SCALE, lambda t: t[:1]),
                    rf"model-0000\d-of-00003\.safetensors: tensor '{SCALE}' has shape \[1, 4\], expected \[4, 4\] "
                    r"for weight_block_size \[16, 16\]"),
    "missing shard": (lambda ck: (ck / "model-00002-of-00003.safetensors").unlink(),
                      r"model\.safetensors\.index\.json: shard 'model-00002-of-00003\.safetensors' \(holding tensor '.*'\) not found"),
    "index lies": (_misplace_scale,
                   rf"model\.safetensors\.index\.json: tensor '{SCALE}' is not in its shard 'model-0000\d-of-00003\.safetensors'"),
}


@pytest.mark.parametrize("case", [*BAD_SINGLE, *BAD_SHARDED])
def test_bad_checkpoint_fails_with_one_line_error(case: str, fp32_dir: Path, fp8_dir: Path, tmp_path: Path) -> None:
    src, (breaks, message) = (fp32_dir, BAD_SINGLE[case]) if case in BAD_SINGLE else (fp8_dir, BAD_SHARDED[case])
    ck = Path(shutil.copytree(src, tmp_path / "ck"))
    breaks(ck)
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(ck, progress=False)
    assert "\n" not in str(err.value)


def test_checkpoint_without_mtp_layers(fp32_dir: Path, reference, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    no_mtp = write_checkpoint(tmp_path / "zero", {**tiny_config(), "num_nextn_predict_layers": 0}, seed=SEED)
    stripped = Path(shutil.copytree(fp32_dir, tmp_path / "stripped"))
    _edit_tensors(stripped / "model.safetensors",
                  lambda t: [t.pop(k) for k in list(t) if k.startswith((f"model.layers.{N}.", f"model.layers.{N + 1}."))])
    token_ids, positions, slots = _inputs()
    for ck in (no_mtp, stripped):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            config, target, mtp = load_checkpoint(ck, progress=False)
        assert mtp is None and config.num_nextn_predict_layers == 0
        assert "no MTP layers: plain decoding only" in caplog.text
    logits, _ = target(token_ids, positions, slots)
    assert torch.equal(logits, reference[1](token_ids, positions, slots)[0])


def test_transformers_loads_synthetic_checkpoint(fp32_dir: Path, reference) -> None:
    from transformers import DeepseekV3ForCausalLM

    hf, info = DeepseekV3ForCausalLM.from_pretrained(fp32_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    token_ids, positions, slots = _inputs()
    with torch.no_grad():
        hf_logits = hf(token_ids).logits  # [2, T, V]
    logits, _ = reference[1](token_ids, positions, slots)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-5)
