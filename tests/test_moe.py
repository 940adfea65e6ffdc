"""The grouped MoE (export/moe.py): the dense MoE's outputs, only the picked experts read, expert-parallel
shards that sum to the whole, a served repository that decodes the dense one's tokens, and refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tiny_config import tiny_config
from triton_mtp.client import Client
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.formats import eager
from triton_mtp.export.model import group_weights
from triton_mtp.export.moe import MoE, default_moe_kind, grouped_mm_works
from triton_mtp.export.parallel import _shard_moe
from triton_mtp.export.repository import write_repository

VOCAB = 128


def random_moe(dtype: torch.dtype, seed: int = 0, **overrides) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(ModelConfig.from_dict({**tiny_config(), **overrides})).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    torch.nn.init.normal_(moe.gate.e_score_correction_bias)
    return moe


def needs_grouped_mm(dtype: torch.dtype) -> None:
    if not grouped_mm_works(torch.device("cpu"), dtype):
        pytest.skip(f"torch.nn.functional.grouped_mm does not run for {dtype} on this CPU build")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 1), (2, 5), (7, 3)])
def test_grouped_moe_matches_the_dense_moe(dtype, tolerance, shape):
    needs_grouped_mm(dtype)
    moe = random_moe(dtype)
    x = torch.randn(*shape, 64, dtype=dtype)  # [B, T, H]
    dense = moe(x)  # [B, T, H]
    moe.group_experts()
    grouped = moe(x)  # [B, T, H]
    assert grouped.shape == dense.shape and grouped.dtype == dense.dtype
    assert (grouped.float() - dense.float()).abs().max() <= tolerance * dense.float().abs().max()


def test_compiled_grouped_moe_equals_eager_in_bf16():
    """Compiled as the eager format's load does (grouped_mm compiles in bf16 only), with eager's rounding:
    the outputs are eager's bit for bit (here all of them; the bound leaves room for another CPU's
    reduction order). Without it about 63% of them differ in their last bits."""
    needs_grouped_mm(torch.bfloat16)
    moe = random_moe(torch.bfloat16)
    moe.group_experts()
    moe.requires_grad_(False)
    compiled = eager.compile_step(moe)
    for shape in [(2, 4), (1, 1), (3, 5)]:
        x = torch.randn(*shape, 64, dtype=torch.bfloat16)  # [B, T, H]
        assert float((compiled(x) == moe(x)).float().mean()) >= 0.95


def test_grouping_stacks_the_experts_once():
    moe = random_moe(torch.float32)
    gate_0 = moe.experts[0].gate_proj.weight.clone()
    down_7 = moe.experts[7].down_proj.weight.clone()
    group_weights(moe, None)
    w13 = moe.w13
    moe.group_experts()  # a second call changes nothing
    assert moe.w13 is w13 and not hasattr(moe, "experts")
    assert torch.equal(moe.w13[0, : gate_0.shape[0]], gate_0) and torch.equal(moe.w2[7], down_7)
    names = {name for name, _ in moe.named_parameters()}
    assert {"w13", "w2"} <= names and not any(name.startswith(("experts.", "shared_experts.")) for name in names)


def test_grouping_holds_the_gate_in_float32_and_routes_alike():
    moe = random_moe(torch.bfloat16)
    x = torch.randn(6, 64, dtype=torch.bfloat16)  # [N, H]
    before = moe.gate.route(x)  # ([N, K], [N, K])
    moe.group_experts()
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    after = moe.gate.route(x)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


@pytest.mark.parametrize("shared_experts", [1, 3])
def test_grouping_folds_the_shared_experts_into_the_stack(shared_experts):
    moe = random_moe(torch.float32, n_shared_experts=shared_experts)
    shared = copy.deepcopy(moe.shared_experts)
    x = torch.randn(5, 64)  # [N, H]
    routed = moe(x) - shared(x)  # [N, H]
    moe.group_experts()
    assert moe.shared_experts is None and (moe.shared_in_stack, moe.routed_in_stack) == (shared_experts, 8)
    assert moe.w13.shape == (8 + shared_experts, 64, 64) and moe.w2.shape == (8 + shared_experts, 64, 32)
    for s in range(shared_experts):  # shared expert s is the MLP's intermediate columns [32 s, 32 s + 32)
        columns = slice(32 * s, 32 * s + 32)
        assert torch.equal(moe.w13[8 + s, :32], shared.gate_proj.weight[columns])
        assert torch.equal(moe.w13[8 + s, 32:], shared.up_proj.weight[columns])
        assert torch.equal(moe.w2[8 + s], shared.down_proj.weight[:, columns])
    moe.unfold_shared_experts()
    assert moe.w13.shape[0] == 8 and moe.shared_in_stack == 0
    for name, param in shared.named_parameters():
        assert torch.equal(moe.shared_experts.get_parameter(name), param)
    if grouped_mm_works(torch.device("cpu"), torch.float32):
        moe.fold_shared_experts()
        assert torch.allclose(moe(x) - shared(x), routed, atol=1e-5, rtol=1e-5)


def test_a_shared_mlp_split_off_whole_experts_stays_a_module():
    """Tensor parallelism over 2 ranks leaves one shared expert's 16 of 32 columns on each: no whole expert."""
    moe = random_moe(torch.float32)
    _shard_moe(moe, 0, 2)
    moe.group_experts()
    assert moe.shared_experts.down_proj.in_features == 16 and moe.shared_in_stack == 0 and moe.w13.shape[0] == 4


def assert_unpicked_experts_unread(moe: MoE, x: torch.Tensor) -> None:
    """Setting the experts no token of x[N, H] picked (at least 2) to NaN leaves the grouped `moe(x)` unchanged."""
    before = moe(x)  # [N, H]
    picked = moe.gate(x).gt(0).any(dim=0)  # [E]
    assert (~picked).sum() >= 2
    routed = picked.numel()
    with torch.no_grad():
        moe.w13[:routed][~picked] = float("nan")
        moe.w2[:routed][~picked] = float("nan")
    assert torch.equal(moe(x), before)


def sharded_sum(moe: MoE, x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The sum of the expert-parallel shards' outputs for x, each shard grouped after sharding."""
    parts = []
    for rank in range(world_size):
        shard = copy.deepcopy(moe)
        _shard_moe(shard, rank, world_size)
        shard.group_experts()
        assert shard.routed_in_stack == moe.gate.num_experts // world_size
        parts.append(shard(x))  # partial sum: picks of other ranks' experts weigh zero
    return torch.stack(parts).sum(0)


def test_experts_no_token_picked_are_never_read():
    needs_grouped_mm(torch.float32)
    moe = random_moe(torch.float32)
    moe.group_experts()
    assert_unpicked_experts_unread(moe, torch.randn(3, 64))  # 3 tokens × top-2 picks of 8 experts


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("grouped_first", [True, False])  # load_sharded shards the dense MoE, then groups
@pytest.mark.parametrize("shared_experts", [1, 2])  # 2 over 2 ranks: one whole shared expert each, folded
def test_expert_parallel_shards_of_the_grouped_moe_sum_to_the_whole(world_size, grouped_first, shared_experts):
    needs_grouped_mm(torch.float32)
    moe = random_moe(torch.float32, n_shared_experts=shared_experts)
    x = torch.randn(2, 4, 64)  # [B, T, H]
    whole = moe(x)  # [B, T, H]
    if grouped_first:
        moe.group_experts()
    assert torch.allclose(sharded_sum(moe, x, world_size), whole, atol=1e-5, rtol=1e-5)


def test_default_kind_is_dense_on_cpu():
    assert default_moe_kind(torch.device("cpu"), torch.bfloat16) == "dense"


@pytest.fixture(scope="module")
def grouped_repository(drafting_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_grouped_mm(torch.float32)
    repo = tmp_path_factory.mktemp("grouped_repository")
    write_repository(drafting_checkpoint, repo, fmt="eager", eager_compile=False, max_slots=4, max_draft_tokens=4,
                     hops="local", moe="grouped", progress=False, log=lambda line: None)
    return repo


def test_the_export_records_the_grouped_kind(grouped_repository):
    assert json.loads((grouped_repository / "export.json").read_text())["moe"] == "grouped"
    reference = json.loads((grouped_repository / "spec_decode" / "1" / "target" / "target.json").read_text())
    assert reference["moe"] == "grouped"


def test_served_grouped_experts_decode_the_dense_experts_tokens(triton_server_for, grouped_repository,
                                                               spec_decode_repository):
    grouped = Client(triton_server_for(grouped_repository).grpc_url, timeout=120)
    dense = Client(triton_server_for(spec_decode_repository).grpc_url, timeout=120)
    gen = torch.Generator().manual_seed(3)
    for k in range(4):
        for n in torch.randint(1, 12, (3,), generator=gen).tolist():
            prompt = torch.randint(2, VOCAB, (n,), generator=gen).tolist()
            ours = grouped.generate(input_ids=prompt, max_tokens=16, num_draft_tokens=k, return_logprobs=True)
            theirs = dense.generate(input_ids=prompt, max_tokens=16, num_draft_tokens=k, return_logprobs=True)
            assert ours.ids == theirs.ids, f"k={k} prompt={prompt}"
            assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


def test_grouped_needs_the_eager_format(drafting_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="moe: grouped needs --format eager"):
        write_repository(drafting_checkpoint, tmp_path, fmt="torchscript", moe="grouped", progress=False)
    with pytest.raises(ValueError, match="moe: must be one of grouped, dense, got 'sparse'"):
        write_repository(drafting_checkpoint, tmp_path, fmt="eager", moe="sparse", progress=False)
    with pytest.raises(ValueError, match="moe: grouped steps compile only in bf16 .*, got fp32"):
        write_repository(drafting_checkpoint, tmp_path, fmt="eager", moe="grouped", progress=False)  # compiles on CPU
    assert not (tmp_path / "target").exists()


def test_eager_references_record_the_kind_and_disagreements_are_named(drafting_checkpoint, tmp_path):
    _, target, _ = load_checkpoint(drafting_checkpoint, max_slots=1, max_seq_len=16, progress=False)
    path = tmp_path / "target.json"
    eager.save(target, (), (), path, checkpoint_dir=drafting_checkpoint, dtype="fp32", moe="grouped")
    graph = eager.load([path], torch.device("cpu"), compile=False)[0]
    assert all(layer.mlp.grouped for layer in graph.module.model.layers if isinstance(layer.mlp, MoE))
    reference = json.loads(path.read_text())
    unknown, other = tmp_path / "unknown.json", tmp_path / "other.json"
    unknown.write_text(json.dumps({**reference, "moe": "sparse"}))
    with pytest.raises(ValueError, match="key 'moe' must be one of grouped, dense, got 'sparse'"):
        eager.load([unknown], torch.device("cpu"))
    other.write_text(json.dumps({**reference, "moe": "dense", "max_slots": 2}))
    with pytest.raises(ValueError, match="differs from .*target.json in max_slots, moe"):
        eager.load([path, other], torch.device("cpu"))
