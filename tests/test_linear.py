"""The decode linear kernel (export/linear.py), run by Triton's interpreter on the CPU: F.linear's outputs, rows
independent of the call's other tokens, the dispatch (few tokens take the kernel, more take F.linear) inside one
op that passes opcheck and splits no compiled size class."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_mtp.export import linear

pytest.importorskip("triton")


@pytest.fixture
def kernels(decode_kernels, monkeypatch):
    """The kernel taken on the CPU; records the tokens of each call that takes it."""
    calls = []
    launch = decode_kernels.linear

    class Recorded:
        def __getitem__(self, grid):
            return lambda x, *args, **kwargs: calls.append(x.shape[0]) or launch[grid](x, *args, **kwargs)

    monkeypatch.setattr(decode_kernels, "linear", Recorded())
    return calls


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# The interpreter truncates where it converts float32 to bf16 (the GPU rounds to nearest, as torch does), so the
# bound is a few bf16 ulps rather than one.
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("T, N, K, block_n, block_k", [(1, 80, 256, 16, 128), (3, 200, 300, 16, 128),
                                                       (8, 33, 130, 32, 64), (5, 7, 20, 16, 16)])
def test_the_kernel_computes_f_linear(kernels, monkeypatch, dtype, tolerance, T, N, K, block_n, block_k):
    """Sizes that are not multiples of the blocks, reductions over several of them, against float32."""
    monkeypatch.setattr(linear, "BLOCK_N", block_n)
    monkeypatch.setattr(linear, "BLOCK_K", block_k)
    torch.manual_seed(0)
    x, weight = torch.randn(T, K, dtype=dtype), torch.randn(N, K, dtype=dtype)  # [T, K], [N, K]
    out = linear.decode_linear(x, weight)  # [T, N]
    assert kernels == [T]
    assert out.shape == (T, N) and out.dtype == dtype
    assert relative_error(out, x.float() @ weight.float().T) <= tolerance


def test_a_tokens_output_does_not_depend_on_the_other_tokens(kernels):
    """A verify window's rows equal one-token calls' rows bit for bit (cuBLAS may pick another kernel per shape)."""
    torch.manual_seed(0)
    x, weight = torch.randn(2, 4, 96, dtype=torch.bfloat16), torch.randn(40, 96, dtype=torch.bfloat16)
    window = linear.decode_linear(x, weight)  # [2, 4, 40]
    for b in range(2):
        for t in range(4):
            assert torch.equal(window[b, t], linear.decode_linear(x[b, t : t + 1], weight)[0])
    assert kernels == [8] + [1] * 8


def test_calls_past_the_bound_and_off_cuda_run_f_linear(kernels):
    torch.manual_seed(0)
    weight = torch.randn(24, 32, dtype=torch.bfloat16)  # [N, K]
    wide = torch.randn(3, linear.MAX_TOKENS, 32, dtype=torch.bfloat16)  # [B, T, K]: 3 x MAX_TOKENS tokens
    assert torch.equal(linear.decode_linear(wide, weight), F.linear(wide, weight))
    assert kernels == []
    module = linear.Linear(32, 24, bias=False, dtype=torch.bfloat16)
    module.weight.data.copy_(weight)
    few = wide[:1, :2]  # [1, 2, K]
    assert torch.equal(module(few), linear.decode_linear(few, weight)) and kernels == [2, 2]
    module.decode_kernel = False  # and for float32, a bias or off CUDA: F.linear itself
    assert torch.equal(module(few), F.linear(few, weight)) and kernels == [2, 2]


@pytest.mark.parametrize("tokens", [2, linear.MAX_TOKENS + 1])
def test_the_dispatch_op_passes_opcheck(kernels, tokens):
    """`linear.decode_linear` against torch.library's checks (schema, fake tensor, dispatch under dynamic shapes)
    on both of its paths."""
    x, weight = torch.randn(tokens, 48, dtype=torch.bfloat16), torch.randn(20, 48, dtype=torch.bfloat16)
    torch.library.opcheck(linear.decode_linear, (x, weight))
    assert bool(kernels) == (tokens <= linear.MAX_TOKENS)


def test_a_compiled_linear_does_not_guard_on_its_tokens(kernels):
    """Under torch.compile(dynamic=True), as served, the bound is inside the op: the shapes on both sides of it
    compile once per size class (batch and tokens of 1 specialize), and the calls within it take the kernel."""
    module = linear.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=True, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
    shapes = [(B, T) for B in (1, 2, 4, 16) for T in (1, 2, 5)]
    try:
        with torch.no_grad():
            for B, T in shapes:
                compiled(torch.randn(B, T, 64, dtype=torch.bfloat16))  # [B, T, K]
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 4  # (1, 1), (1, >1), (>1, 1), (>1, >1), as dynamo specializes sizes 0 and 1
    assert kernels == [B * T for B, T in shapes if B * T <= linear.MAX_TOKENS]
