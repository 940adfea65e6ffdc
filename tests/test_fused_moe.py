"""The decode path of the grouped MoE (export/fused_moe.py), run by Triton's interpreter on the CPU: the
grouped path's outputs, only the picked experts read, expert-parallel shards that sum to the whole, and
the dispatch (few picks take the kernels, many the grouped GEMMs)."""

from __future__ import annotations

import copy

import pytest
import torch

from test_moe import assert_unpicked_experts_unread, needs_grouped_mm, random_moe, sharded_sum
from triton_mtp.export import fused_moe, moe as moe_module

pytest.importorskip("triton")


@pytest.fixture
def kernels(decode_kernels, monkeypatch):
    """The kernels taken on the CPU (tests/conftest.py); records each call that takes the expert kernels as
    (tokens, routed picks, shared experts)."""
    calls = []
    fused = fused_moe.fused_experts
    monkeypatch.setattr(fused_moe, "fused_experts",
                        lambda *args: calls.append((*args[4].shape, *args[5:])) or fused(*args))
    return calls


@pytest.fixture
def routes(kernels, monkeypatch):
    """With the kernels: records the tokens of each call of the routing kernel."""
    calls = []
    route = fused_moe.route
    monkeypatch.setattr(fused_moe, "route", lambda gate, x: calls.append(x.shape[0]) or route(gate, x))
    return calls


def grouped_pair(dtype: torch.dtype, seed: int = 0):
    """The same grouped MoE twice: with the decode kernels and without."""
    needs_grouped_mm(dtype)
    moe = random_moe(dtype, seed)
    moe.group_experts()
    plain = copy.deepcopy(moe)
    plain.fused_decode = False
    return moe, plain


# The interpreter truncates where it converts float32 to bf16 (the GPU rounds to nearest, as torch does),
# which biases the kernels' four roundings: bf16 gets a wider bound here than on the GPU (bench/fused_moe.py).
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 4), (2, 2)])  # 2 to 8 picks of 8 experts
def test_the_kernels_compute_the_grouped_moe(kernels, routes, dtype, tolerance, shape):
    moe, plain = grouped_pair(dtype)
    x = torch.randn(*shape, 64, dtype=dtype)  # [B, T, H]
    fused, grouped = moe(x), plain(x)  # [B, T, H] each
    assert kernels == [(shape[0] * shape[1], 2, 1)]  # the shared expert folded in
    assert routes == [shape[0] * shape[1]]  # routed by the kernel too; the plain MoE by Gate.route
    assert fused.shape == grouped.shape and fused.dtype == grouped.dtype
    assert (fused.float() - grouped.float()).abs().max() <= tolerance * grouped.float().abs().max()


@pytest.mark.parametrize("H, I, block_n, block_k, S",
                         [(200, 72, 16, 128, 0), (33, 7, 32, 16, 2), (300, 140, 16, 64, 1)])
def test_the_kernels_compute_each_pair_over_several_blocks(kernels, monkeypatch, H, I, block_n, block_k, S):
    """Sizes that are not multiples of the blocks, reductions over several of them, and S shared experts after
    the routed ones, against float32 einsums."""
    monkeypatch.setattr(fused_moe, "BLOCK_N", block_n)
    monkeypatch.setattr(fused_moe, "BLOCK_K", block_k)
    torch.manual_seed(0)
    E, N, K = 5, 3, 2
    w13, w2 = torch.randn(E + S, 2 * I, H), torch.randn(E + S, H, I)  # [E+S, 2I, H], [E+S, H, I]
    x, top_w, top_idx = torch.randn(N, H), torch.rand(N, K), torch.randint(0, E, (N, K))  # [N, H], [N, K], [N, K]
    picks = torch.cat([top_idx, torch.arange(E, E + S).expand(N, S)], 1)  # [N, K+S]
    h13 = torch.einsum("nkoh,nh->nko", w13[picks], x)  # [N, K+S, 2I]
    gate, up = h13.chunk(2, dim=-1)  # [N, K+S, I] each
    ys = torch.einsum("nkhi,nki->nkh", w2[picks], torch.nn.functional.silu(gate) * up)  # [N, K+S, H]
    expected = ys * torch.cat([top_w, torch.ones(N, S)], 1)[..., None]  # [N, K+S, H]
    out = fused_moe.fused_experts(x, w13, w2, top_w, top_idx, S)  # [N, K+S, H]
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()  # summation order alone


@pytest.mark.parametrize("overrides", [
    {},  # 8 experts in 2 groups, top-2 of the best group
    {"n_group": 1, "topk_group": 1},  # no group limit (DeepSeek-V2-Lite)
    {"n_routed_experts": 12, "n_group": 2, "num_experts_per_tok": 3},  # groups of 6: padded blocks
    {"n_routed_experts": 12, "n_group": 3, "topk_group": 2},  # 3 groups: a padded group
    {"n_group": 4, "topk_group": 2, "norm_topk_prob": False},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_routing_kernel_picks_the_gates_experts(kernels, overrides, dtype):
    moe = random_moe(dtype, **overrides)
    x = torch.randn(9, 64, dtype=dtype)  # [N, H]
    (w, idx), (kernel_w, kernel_idx) = moe.gate.route(x), fused_moe.route(moe.gate, x)  # [N, K] each
    assert torch.equal(kernel_idx, idx)  # the same experts in the same order
    assert kernel_w.dtype == torch.float32 and torch.allclose(kernel_w, w, rtol=1e-6, atol=1e-6)


def test_the_routing_kernel_picks_experts_in_range_from_nan_logits(kernels):
    moe = random_moe(torch.float32)  # 8 experts, no shared one folded: an id of 8 would read past the stack
    x = torch.full((2, 64), float("nan"))  # [N, H]
    _, idx = fused_moe.route(moe.gate, x)  # [N, K]
    assert ((idx >= 0) & (idx < 8)).all()


def test_more_picks_than_experts_take_the_grouped_gemms_unless_their_bytes_are_few(kernels, monkeypatch):
    moe, plain = grouped_pair(torch.float32)
    x = torch.randn(4, 64)  # [N, H]: 4 × (2 routed + 1 shared) = 12 picks of 9 experts of 24 KiB each
    monkeypatch.setattr(fused_moe, "REREAD_BYTES", 12 * 24 * 1024 - 1)
    # Not bit for bit: the routing kernel's sigmoid (the interpreter's numpy) and torch's may differ in the last
    # bit, by host CPU.
    assert torch.allclose(moe(x), plain(x), atol=1e-5, rtol=1e-5) and kernels == []
    monkeypatch.setattr(fused_moe, "REREAD_BYTES", 12 * 24 * 1024)
    assert torch.allclose(moe(x), plain(x), atol=1e-5, rtol=1e-5) and kernels == [(4, 2, 1)]


def test_the_kernels_read_only_the_picked_experts(kernels):
    moe, _ = grouped_pair(torch.float32)
    assert_unpicked_experts_unread(moe, torch.randn(3, 64))  # 6 routed picks of 8 experts, 3 of the shared one
    assert len(kernels) == 2  # both calls took the kernels


@pytest.mark.parametrize("world_size, shared_experts", [(2, 1), (4, 1), (2, 2)])  # (2, 2): one folded per rank
def test_expert_parallel_shards_sum_to_the_whole(kernels, world_size, shared_experts):
    needs_grouped_mm(torch.float32)
    moe = random_moe(torch.float32, n_shared_experts=shared_experts)
    x = torch.randn(1, 1, 64)  # [B, T, H]: 2 picks, within every shard's experts
    whole = moe(x)  # [B, T, H] (dense)
    assert torch.allclose(sharded_sum(moe, x, world_size), whole, atol=1e-5, rtol=1e-5)
    assert [call[-1] for call in kernels] == [shared_experts // world_size] * world_size  # every shard took them


def test_grouping_loads_the_kernels_which_run_only_on_cuda(monkeypatch):
    monkeypatch.setattr(fused_moe, "KERNELS", None)
    moe = random_moe(torch.float32)
    moe.group_experts()
    assert fused_moe.KERNELS is not None
    assert not fused_moe.runs_on(torch.device("cpu")) and fused_moe.runs_on(torch.device("cuda"))


@pytest.mark.parametrize("tokens", [2, 5])  # within and past a bound of 3 tokens
def test_the_dispatch_op_passes_opcheck(kernels, tokens):
    """`moe.routed_experts` against torch.library's checks (schema, fake tensor, dispatch under dynamic shapes) on
    both of its paths; the calls within the bound take the kernels."""
    needs_grouped_mm(torch.float32)
    moe = random_moe(torch.float32)
    moe.group_experts()
    flat = torch.randn(tokens, moe.w13.shape[2])  # [N, H]
    with torch.no_grad():  # an inference op: no autograd formula
        top_w, top_idx = moe.gate.route(flat)  # [N, K] each
    torch.library.opcheck(moe_module.routed_experts, (flat, moe.w13, moe.w2, top_w, top_idx, moe.shared_in_stack, 3))
    assert bool(kernels) == (tokens <= 3)


def test_a_compiled_moe_does_not_guard_on_its_tokens(monkeypatch):
    """Under torch.compile(dynamic=True), as served, the dispatch between the kernels and the grouped GEMMs is
    inside one op (`moe.routed_experts`), so it splits no size class (batch and tokens of 1 specialize): the
    served shapes on both sides of `max_tokens` compile once per class. The kernel calls are stubbed with torch
    ops of their shape (the interpreter does not trace under dynamo); the stub runs for the calls within the
    bound, which shows the dispatch still happens."""
    needs_grouped_mm(torch.bfloat16)
    moe = random_moe(torch.bfloat16)
    moe.group_experts()
    monkeypatch.setattr(fused_moe, "runs_on", lambda device: True)
    monkeypatch.setattr(fused_moe, "route", lambda gate, x: gate.route(x))
    monkeypatch.setattr(fused_moe, "REREAD_BYTES", 3 * 40 * 12 * 1024)  # 3 picks of 12 KiB bf16 experts: 40 tokens
    assert fused_moe.max_tokens(3, moe.w13, moe.w2) == 40
    graphs, taken = [], []  # compiled variants; tokens of the calls that took the kernels
    monkeypatch.setattr(fused_moe, "fused_experts",
                        lambda x, w13, w2, top_w, top_idx, shared:
                        taken.append(x.shape[0]) or x.float()[:, None].expand(-1, top_idx.shape[1] + shared, -1))
    torch._dynamo.reset()
    compiled = torch.compile(moe, dynamic=True, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
    try:
        with torch.no_grad():
            for B in (1, 2, 4, 8, 16, 32, 64):
                for T in (1, 2, 5):
                    compiled(torch.randn(B, T, 64, dtype=torch.bfloat16))  # [B, T, H]
    finally:
        torch._dynamo.reset()
    # (1, 1), (1, >1), (>1, 1), (>1, >1); with the dispatch as a branch in the traced code, (>1, 1) and (>1, >1)
    # split again past 40 tokens (6), and the two rules as two comparisons made 8. The count follows dynamo's
    # specialization of sizes 0 and 1 (torch 2.13).
    assert len(graphs) == 4
    assert taken == [B * T for B in (1, 2, 4, 8, 16, 32, 64) for T in (1, 2, 5) if B * T <= 40]
