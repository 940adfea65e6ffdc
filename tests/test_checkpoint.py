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
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.errors import CheckpointError
from triton_mtp.export.model import DeepseekV3MTP, DeepseekV3Target
from triton_mtp.export.synthetic import random_weights, write_checkpoint
from tiny_config import tiny_config

SEED = 3
BLOCK = [16, 16]  # several blocks per tiny matrix, with padded edges (e.g. kv_a_proj_with_mqa is 40 x 64)
N = tiny_config()["num_hidden_layers"]
Loaded = tuple[ModelConfig, DeepseekV3Target, DeepseekV3MTP | None]


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("fp32"), tiny_config(), seed=SEED)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = {**tiny_config(), "quantization_config": {"quant_method": "fp8", "weight_block_size": BLOCK}}
    return write_checkpoint(tmp_path_factory.mktemp("fp8"), cfg, seed=SEED, shards=3, fp8=True, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def reference(fp32_dir: Path) -> Loaded:
    """The fp32 checkpoint loaded: the unquantized twin of the FP8 one (same seed)."""
    return load_checkpoint(fp32_dir, progress=False)


def _inputs(T: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, tiny_config()["vocab_size"], (2, T), generator=gen)  # [2, T]
    positions = torch.arange(T).repeat(2, 1)  # [2, T]
    return token_ids, positions, torch.tensor([0, 1])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _state(target: DeepseekV3Target, mtp: DeepseekV3MTP | None) -> dict[str, torch.Tensor]:
    return {**target.state_dict(), **(mtp.state_dict() if mtp is not None else {})}


def test_sharded_fp8_checkpoint_matches_its_unquantized_twin(fp8_dir: Path, reference: Loaded) -> None:
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


def test_bf16_load(fp32_dir: Path, reference: Loaded) -> None:
    _, target, mtp = load_checkpoint(fp32_dir, dtype="bf16", max_slots=2, max_seq_len=16, progress=False)
    assert {p.dtype for p in [*target.parameters(), *mtp.parameters()]} == {torch.bfloat16}
    assert target.kv_cache.shape[1:3] == (2, 17)
    token_ids, positions, slots = _inputs()
    logits, _ = target(token_ids, positions, slots)
    assert _rel_err(logits, reference[1](token_ids, positions, slots)[0]) < 0.03


def test_dtype_names() -> None:
    assert [resolve_dtype(d) for d in ("float16", "torch.bfloat16", torch.float32)] == [
        torch.float16, torch.bfloat16, torch.float32]
    with pytest.raises(ValueError, match="^dtype: unsupported 'int8'"):
        resolve_dtype("int8")


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _drop(tensors: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> None:
    for name in [n for n in tensors if n.startswith(prefixes)]:
        del tensors[name]


def _weight_map(ck: Path) -> dict[str, str]:
    return json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]


SCALE = "model.layers.2.self_attn.o_proj.weight_scale_inv"  # o_proj is 64 x 64: 4 x 4 blocks of 16
SHARD = r"model-0000\d-of-00003\.safetensors"
BAD: dict[str, tuple[str, Callable[[Path], None], str]] = {}  # case -> (good checkpoint, how to break it, error)


def bad(source: str, message: str) -> Callable[[Callable[[Path], None]], Callable[[Path], None]]:
    """Register a way to break a copy of the `source` ("fp32" single file or "fp8" sharded) checkpoint."""
    def register(breaks: Callable[[Path], None]) -> Callable[[Path], None]:
        BAD[breaks.__name__] = (source, breaks, message)
        return breaks
    return register


@bad("fp32", r"config\.json: file not found$")
def no_config(ck: Path) -> None:
    (ck / "config.json").unlink()


@bad("fp32", r"config\.json: missing required key 'hidden_size'$")
def config_key_missing(ck: Path) -> None:
    _edit_json(ck / "config.json", lambda d: d.pop("hidden_size"))


@bad("fp8", r"config\.json: unsupported quantization_config \(quant_method 'awq', fmt 'e4m3'; "
            r"expected 'fp8', 'e4m3'\)$")
def other_quantization(ck: Path) -> None:
    _edit_json(ck / "config.json", lambda d: d["quantization_config"].update(quant_method="awq"))


@bad("fp32", r"model\.safetensors: tensor 'model\.norm\.weight' has unsupported dtype I64$")
def integer_weight(ck: Path) -> None:
    integers = torch.ones(64, dtype=torch.int64)  # [H]
    _edit_tensors(ck / "model.safetensors", lambda t: t.update({"model.norm.weight": integers}))


@bad("fp32", r"config\.json: unsupported model_type 'llama'")
def other_model_type(ck: Path) -> None:
    _edit_json(ck / "config.json", lambda d: d.update(model_type="llama"))


@bad("fp32", r"ck: missing tensors model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight, "
             r"model\.layers\.1\.mlp\.experts\.1\.up_proj\.weight, model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight "
             r"\(and 2 more\)$")
def tensors_missing(ck: Path) -> None:
    experts = tuple(f"model.layers.1.mlp.experts.{e}.up_proj." for e in range(5))
    _edit_tensors(ck / "model.safetensors", lambda t: _drop(t, experts))


@bad("fp32", rf"ck: missing tensors model\.layers\.{N + 1}\.")
def second_mtp_layer_missing(ck: Path) -> None:
    _edit_tensors(ck / "model.safetensors", lambda t: _drop(t, (f"model.layers.{N + 1}.",)))


@bad("fp32", r"model\.safetensors: unexpected tensors model\.layers\.0\.mlp\.extra\.weight$")
def tensor_unexpected(ck: Path) -> None:
    _edit_tensors(ck / "model.safetensors", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))


@bad("fp32", r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[65\], expected \[64\]$")
def shape_mismatch(ck: Path) -> None:
    _edit_tensors(ck / "model.safetensors", lambda t: t.update({"model.norm.weight": torch.ones(65)}))


@bad("fp32", rf"model\.safetensors: tensor 'model\.layers\.{N}\.shared_head\.head\.weight' "
             r"differs from 'lm_head\.weight'")
def mtp_head_not_shared(ck: Path) -> None:
    _edit_tensors(ck / "model.safetensors", lambda t: t[f"model.layers.{N}.shared_head.head.weight"].mul_(2))


@bad("fp32", r"model\.safetensors: unreadable safetensors file \(.*\)$")
def truncated_file(ck: Path) -> None:
    path = ck / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])


@bad("fp32", r"model\.safetensors: unreadable safetensors file \(.*header.*\)$")
def bad_header(ck: Path) -> None:
    (ck / "model.safetensors").write_bytes(b"\x20" + b"\x00" * 7 + b"{not json" + b" " * 40)


@bad("fp32", r"ck: no model\.safetensors or model\.safetensors\.index\.json found$")
def no_weights(ck: Path) -> None:
    (ck / "model.safetensors").unlink()


@bad("fp8", rf"{SHARD}: FP8 tensor '{SCALE.removesuffix('_scale_inv')}' has no '{SCALE}'$")
def scale_missing(ck: Path) -> None:
    _edit_tensors(ck / _weight_map(ck)[SCALE], lambda t: t.pop(SCALE))
    _edit_json(ck / "model.safetensors.index.json", lambda d: d["weight_map"].pop(SCALE))


@bad("fp8", rf"{SHARD}: tensor '{SCALE}' has shape \[1, 4\], expected \[4, 4\] for weight_block_size \[16, 16\]$")
def scale_shape(ck: Path) -> None:
    _edit_tensors(ck / _weight_map(ck)[SCALE], lambda t: t.update({SCALE: t[SCALE][:1]}))


@bad("fp8", r"model\.safetensors\.index\.json: shard 'model-00002-of-00003\.safetensors' \(holding tensor '.*'\) "
            r"not found$")
def shard_missing(ck: Path) -> None:
    (ck / "model-00002-of-00003.safetensors").unlink()


@bad("fp8", rf"model\.safetensors\.index\.json: tensor '{SCALE}' is not in its shard '{SHARD}'$")
def index_names_wrong_shard(ck: Path) -> None:
    own = _weight_map(ck)[SCALE]
    other = next(f for f in sorted(set(_weight_map(ck).values())) if f != own)
    _edit_json(ck / "model.safetensors.index.json", lambda d: d["weight_map"].update({SCALE: other}))


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint_fails_with_one_line_error(case: str, fp32_dir: Path, fp8_dir: Path, tmp_path: Path) -> None:
    source, breaks, message = BAD[case]
    ck = Path(shutil.copytree(fp32_dir if source == "fp32" else fp8_dir, tmp_path / "ck"))
    breaks(ck)
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(ck, progress=False)
    assert "\n" not in str(err.value)


def test_checkpoint_without_mtp_layers(
    fp32_dir: Path, reference: Loaded, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    no_mtp = write_checkpoint(tmp_path / "zero", {**tiny_config(), "num_nextn_predict_layers": 0}, seed=SEED)
    stripped = Path(shutil.copytree(fp32_dir, tmp_path / "stripped"))
    _edit_tensors(stripped / "model.safetensors", lambda t: _drop(t, (f"model.layers.{N}.", f"model.layers.{N + 1}.")))
    token_ids, positions, slots = _inputs()
    for ck in (no_mtp, stripped):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            config, target, mtp = load_checkpoint(ck, progress=False)
        assert mtp is None and config.num_nextn_predict_layers == 0
        assert "no MTP layers: plain decoding only" in caplog.text
    logits, _ = target(token_ids, positions, slots)
    assert torch.equal(logits, reference[1](token_ids, positions, slots)[0])


def test_transformers_loads_synthetic_checkpoint(fp32_dir: Path, reference: Loaded) -> None:
    from transformers import DeepseekV3ForCausalLM

    hf, info = DeepseekV3ForCausalLM.from_pretrained(fp32_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    token_ids, positions, slots = _inputs()
    with torch.no_grad():
        hf_logits = hf(token_ids).logits  # [2, T, V]
    logits, _ = reference[1](token_ids, positions, slots)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-5)
