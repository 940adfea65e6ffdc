"""`triton-mtp export` writes a complete model repository that a real tritonserver serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from reference import greedy_completion
from tiny_config import tiny_config
from triton_mtp.cli import main
from triton_mtp.client import Client
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.formats import eager
from triton_mtp.export.linear import Linear
from triton_mtp.export.mla import MLAttention
from triton_mtp.export.moe import Gate
from triton_mtp.export.graphs import load_step
from triton_mtp.export.synthetic import write_checkpoint

MAX_SLOTS, MAX_SEQ_LEN = 3, 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Tiny random checkpoint with a word-level tokenizer.json."""
    directory = tmp_path_factory.mktemp("checkpoint")
    write_checkpoint(directory, tiny_config())
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, tiny_config()["vocab_size"])}}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    return directory


def export(checkpoint: Path, repository: Path, *extra: str) -> int:
    return main(["export", "--checkpoint", str(checkpoint), "--repository", str(repository),
                 "--max-slots", str(MAX_SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), *extra])


@pytest.fixture(scope="module")
def repository(checkpoint, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("repository")
    assert export(checkpoint, repo, "--max-draft-tokens", "3", "--max-queue-size", "7") == 0
    return repo


def test_repository_has_every_model_file(repository):
    expected = [
        "export.json",
        "mtp/1/model.py", "mtp/1/mtp_0.pt", "mtp/1/mtp_1.pt", "mtp/config.pbtxt",
        "spec_decode/1/model.py", "spec_decode/1/tokenizer.json", "spec_decode/config.pbtxt",
        "target/1/model.py", "target/1/target.pt", "target/config.pbtxt",
    ]
    written = sorted(str(p.relative_to(repository)) for p in repository.rglob("*") if p.is_file())
    assert written == expected


def test_configs_are_rendered_with_the_export_settings(repository):
    for name in ("target", "mtp", "spec_decode"):
        text = (repository / name / "config.pbtxt").read_text()
        assert "${" not in text
        assert f'name: "{name}"' in text
    parameters = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}',
                                 (repository / "spec_decode" / "config.pbtxt").read_text()))
    assert parameters["max_draft_tokens"] == "3"
    assert parameters["max_queue_size"] == "7"
    assert parameters["default_num_draft_tokens"] == "2"  # two MTP layers
    assert parameters["eos_token_id"] == "1"
    assert "kind: KIND_CPU" in (repository / "target" / "config.pbtxt").read_text()


def test_manifest_records_settings_artifacts_and_parity(repository):
    manifest = json.loads((repository / "export.json").read_text())
    assert (manifest["format"], manifest["dtype"], manifest["device"]) == ("torchscript", "fp32", "cpu")
    assert manifest["sizes"]["max_slots"] == MAX_SLOTS and manifest["sizes"]["max_seq_len"] == MAX_SEQ_LEN
    assert manifest["model_config"]["num_nextn_predict_layers"] == 2
    assert all((repository / path).is_file() for path in manifest["artifacts"].values())
    assert set(manifest["parity_max_relative_error"]) == {"target", "mtp_0", "mtp_1"}
    assert all(e < 1e-4 for e in manifest["parity_max_relative_error"].values())


def test_exported_target_reproduces_the_checkpoint(repository, checkpoint):
    _, target, _ = load_checkpoint(checkpoint, "fp32", "cpu", MAX_SLOTS, MAX_SEQ_LEN, progress=False)
    runner = load_step(repository / "target" / "1", "torchscript", "cpu")
    token_ids = torch.tensor([[5, 9, 11, 40]])  # [1, 4]
    positions = torch.arange(4)[None]  # [1, 4]
    slot_ids = torch.tensor([1])  # [1]
    with torch.no_grad():
        torch.testing.assert_close(runner(token_ids, positions, slot_ids)[0], target(token_ids, positions, slot_ids)[0])


@pytest.fixture(scope="module")
def onnx_repository(checkpoint, tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("onnx_repository")
    assert export(checkpoint, repo, "--format", "onnx", "--max-draft-tokens", "2") == 0
    return repo


def greedy_eager(checkpoint: Path, prompt: list[int], max_tokens: int) -> list[int]:
    _, target, _ = load_checkpoint(checkpoint, "fp32", "cpu", 1, MAX_SEQ_LEN, progress=False)
    return greedy_completion(target, prompt, max_tokens)


@pytest.mark.parametrize("repo_fixture", ["repository", "onnx_repository"])
def test_served_repository_completes_like_greedy_eager(repo_fixture, request, checkpoint, triton_server_for):
    server = triton_server_for(request.getfixturevalue(repo_fixture))
    prompt = [5, 6, 7, 8, 9]
    with Client(server.grpc_url, timeout=120) as client:
        completion = client.generate(input_ids=prompt, max_tokens=8)
    assert completion.ids == greedy_eager(checkpoint, prompt, 8)
    assert completion.finish_reason == "length"


def test_eager_format_writes_a_checkpoint_reference(checkpoint, tmp_path):
    assert export(checkpoint, tmp_path, "--format", "eager", "--no-compile", "--compile-graphs") == 0
    reference = json.loads((tmp_path / "target" / "1" / "target.json").read_text())
    assert reference["checkpoint"] == str(checkpoint.resolve())
    assert (reference["max_slots"], reference["max_seq_len"], reference["compile"]) == (MAX_SLOTS, MAX_SEQ_LEN, False)
    assert sorted(p.name for p in (tmp_path / "mtp" / "1").glob("mtp_*.json")) == ["mtp_0.json", "mtp_1.json"]
    for model in ("target", "mtp", "spec_decode"):  # graphed models on cuda capture compiled steps
        config = (tmp_path / model / "config.pbtxt").read_text()
        assert 'key: "compile_graphs", value: { string_value: "true" }' in config, model


def test_the_eager_reference_records_the_decode_kernels_and_its_load_applies_them(checkpoint, tmp_path):
    """`--decode-kernels` in the artifacts and the manifest; a load turns those paths on and the others off
    (they run where the kernels do: CUDA with the grouped MoE). A reference written before the choice was recorded
    loads with the default, the linear kernel alone."""
    assert export(checkpoint, tmp_path, "--format", "eager", "--no-compile", "--decode-kernels", "attention,router") == 0
    for artifact in ("target/1/target.json", "mtp/1/mtp_0.json"):
        assert json.loads((tmp_path / artifact).read_text())["decode_kernels"] == ["attention", "router"]
    assert json.loads((tmp_path / "export.json").read_text())["decode_kernels"] == ["attention", "router"]
    path = tmp_path / "target" / "1" / "target.json"

    def chosen() -> dict[type, set[bool]]:
        target = eager.load([path], torch.device("cpu"))[0].module
        return {kind: {m.decode_kernel for m in target.modules() if isinstance(m, kind)}
                for kind in (Linear, MLAttention, Gate)}

    assert chosen() == {Linear: {False}, MLAttention: {True}, Gate: {True}}
    reference = json.loads(path.read_text())
    del reference["decode_kernels"]
    path.write_text(json.dumps(reference))
    assert chosen() == {Linear: {True}, MLAttention: {False}, Gate: {False}}


def test_reexport_replaces_the_previous_models(checkpoint, tmp_path):
    assert export(checkpoint, tmp_path) == 0
    (tmp_path / "target" / "1" / "stale.pt").write_bytes(b"")
    assert main(["export", "--checkpoint", str(checkpoint), "--repository", str(tmp_path),
                 "--max-slots", "2", "--max-seq-len", "16", "--max-draft-tokens", "2"]) == 0
    assert not (tmp_path / "target" / "1" / "stale.pt").exists()
    assert json.loads((tmp_path / "export.json").read_text())["sizes"]["max_slots"] == 2
    assert 'string_value: "16"' in (tmp_path / "target" / "config.pbtxt").read_text()


@pytest.mark.parametrize("flags", [["--format", "tensorrt"], ["--max-slots", "0"], ["--dtype", "int8"],
                                   ["--decode-kernels", "linear,flash"]])
def test_usage_errors_exit_2(checkpoint, tmp_path, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        export(checkpoint, tmp_path, *flags)
    assert exc.value.code == 2
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-draft-tokens", "2", "--default-num-draft-tokens", "3"],
         "default_num_draft_tokens: must be in [0, max_draft_tokens=2], got 3"),
        (["--format", "onnx", "--dtype", "bf16"], "format onnx: dtype bfloat16 is not supported"),
        (["--max-draft-tokens", "30"], "max_seq_len: 32 leaves no room for a verify window of 31 tokens"),
    ],
)
def test_bad_settings_exit_1_with_one_line(checkpoint, tmp_path, flags, message, capsys):
    assert export(checkpoint, tmp_path, *flags) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"triton-mtp export: error: {message}")
    assert not (tmp_path / "target").exists()


def test_missing_checkpoint_exits_1_naming_it(tmp_path, capsys):
    assert export(tmp_path / "absent", tmp_path / "repo") == 1
    assert capsys.readouterr().err == f"triton-mtp export: error: checkpoint: {tmp_path / 'absent'} is not a directory\n"
