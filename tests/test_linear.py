"""The decode linear kernel (export/linear.py), run by Triton's interpreter on the CPU: F.linear's outputs, and the
dispatch (one-token calls of small weights take the kernel; more tokens, large weights, float32 and a bias take
F.linear) inside one op that passes opcheck and splits no compiled size class; the router's float32 decode logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from triton_mtp.export import linear
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.moe import Gate

pytest.importorskip("triton")


@pytest.fixture
def kernels(record_launches):
    """The kernel taken on the CPU; records the weight rows of each call that takes it."""
    return record_launches("linear", lambda args: args[1].shape[0])


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# The interpreter truncates where it converts float32 to bf16 (the GPU rounds to nearest, as torch does), so the
# bound is a few bf16 ulps rather than one.
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("N, K, block_n, block_k", [(80, 256, 8, 128), (200, 300, 16, 128), (33, 130, 32, 64),
                                                    (7, 20, 16, 16)])
def test_the_kernel_computes_f_linear(kernels, monkeypatch, dtype, tolerance, N, K, block_n, block_k):
    """Sizes that are not multiples of the blocks and reductions over several of them, against float32."""
    monkeypatch.setattr(linear, "BLOCK_N", block_n)
    monkeypatch.setattr(linear, "BLOCK_K", block_k)
    torch.manual_seed(0)
    x, weight = torch.randn(1, 1, K, dtype=dtype), torch.randn(N, K, dtype=dtype)  # [B, T, K], [N, K]
    out = linear.decode_linear(x, weight)  # [1, 1, N]
    assert kernels == [N]
    assert out.shape == (1, 1, N) and out.dtype == dtype
    assert relative_error(out, x.float() @ weight.float().T) <= tolerance


def test_the_module_takes_the_kernel_only_for_one_token_of_a_small_half_precision_weight(kernels, monkeypatch):
    torch.manual_seed(0)
    module = linear.Linear(32, 24, bias=False, dtype=torch.bfloat16)
    one, two = torch.randn(1, 1, 32, dtype=torch.bfloat16), torch.randn(1, 2, 32, dtype=torch.bfloat16)
    assert torch.equal(module(one), linear.decode_linear(one, module.weight)) and kernels == [24, 24]
    assert torch.equal(module(two), F.linear(two, module.weight)) and kernels == [24, 24]  # two tokens: cuBLAS
    monkeypatch.setattr(linear, "MAX_WEIGHT_BYTES", 24 * 32 * 2 - 1)  # a weight past the bound
    assert torch.equal(module(one), F.linear(one, module.weight)) and kernels == [24, 24]
    monkeypatch.undo()
    module.decode_kernel = False  # as for float32, a bias or off CUDA: F.linear itself
    assert torch.equal(module(one), F.linear(one, module.weight)) and kernels == [24, 24]


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_dispatch_op_passes_opcheck(kernels, tokens):
    """`linear.decode_linear` against torch.library's checks (schema, fake tensor, dispatch under dynamic shapes)
    on both of its paths."""
    x, weight = torch.randn(tokens, 48, dtype=torch.bfloat16), torch.randn(20, 48, dtype=torch.bfloat16)
    torch.library.opcheck(linear.decode_linear, (x, weight))
    assert bool(kernels) == (tokens == 1)


def test_a_compiled_linear_does_not_guard_on_its_tokens(kernels):
    """Under torch.compile(dynamic=True), as served, the dispatch is inside the op: the shapes compile once per size
    class (batch and tokens of 1 specialize), and the one-token calls take the kernel."""
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
    assert kernels == [32]  # the one call of one token


def test_the_router_takes_the_kernel_for_its_float32_decode_logits_once_turned_on(kernels):
    """Off by default; then the gate's logits (float32 weight and input) of one token take the kernel, of two
    F.linear, and agree."""
    config = ModelConfig.from_checkpoint(Path(__file__).resolve().parents[1] / "models" / "tiny-dsv3-mtp")
    torch.manual_seed(0)
    gate = Gate(config).to(torch.bfloat16)
    torch.nn.init.normal_(gate.weight)
    gate.hold_float32()
    one, two = torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(2, 256, dtype=torch.bfloat16)  # [N, H]
    assert torch.equal(gate.logits(one), F.linear(one.float(), gate.weight)) and kernels == []
    gate.decode_kernel = True
    logits = gate.logits(one)  # [1, E]
    assert kernels == [8] and logits.dtype == torch.float32
    assert torch.allclose(logits, F.linear(one.float(), gate.weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(gate.logits(two), F.linear(two.float(), gate.weight)) and kernels == [8]
