"""The absorbed MLA's decode kernels (export/latent_attention.py), run by Triton's interpreter on the CPU: the eager
attention's outputs over several chunks, head blocks and padded tokens, the dispatch (calls of few tokens take the
kernels, more tokens or partial results past the bound take the eager ops inside the op), an op that passes
opcheck, and an attention layer that takes it. In float16: this Triton's interpreter computes bf16 dots wrongly
(bf16 runs on the GPU, where bench/decode_kernels.py reports its error against the compiled eager ops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triton_mtp.export import latent_attention
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.mla import MLAttention

pytest.importorskip("triton")

LAYERS, SLOTS = 2, 3
BUNDLED = Path(__file__).resolve().parents[1] / "models" / "tiny-dsv3-mtp"


@pytest.fixture
def kernels(record_launches):
    """The kernels taken on the CPU; records the tokens of each call that takes them."""
    return record_launches("absorb_query", lambda args: args[3])


def inputs(B, T, heads, dn, dv, r, dr, seq, dtype=torch.float16, seed=0):
    """q_nope [B, T, h, dn], q_pe [B, T, h, dr], w_kv [h, dn + dv, r], cache [L, S, seq, r + dr], slots [B],
    positions [B, T] (the first token padding where there are several)."""
    generator = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(B, T, heads, dn, generator=generator).to(dtype)
    q_pe = torch.randn(B, T, heads, dr, generator=generator).to(dtype)
    w_kv = (torch.randn(heads, dn + dv, r, generator=generator) * 0.1).to(dtype)
    cache = torch.randn(LAYERS, SLOTS, seq, r + dr, generator=generator).to(dtype)
    slots = torch.tensor([2, 0, 1][:B])
    positions = torch.randint(0, seq - 1, (B, T), generator=generator)
    if T > 1:
        positions[0, 0] = -1
    return q_nope, q_pe, w_kv, cache, slots, positions


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# (B, T, heads, dn, dv, r, dr, seq, CHUNK): V2-Lite's head and ranks; ranks and heads that are not powers of two or
# multiples of the blocks (20 heads: two head blocks), chunks of several position blocks, padding.
SHAPES = [(1, 1, 16, 128, 128, 512, 64, 90, 64), (2, 3, 4, 16, 8, 32, 16, 40, 16), (1, 2, 20, 8, 12, 24, 8, 50, 32),
          (3, 1, 2, 8, 8, 16, 8, 70, 64)]


@pytest.mark.parametrize("B, T, heads, dn, dv, r, dr, seq, chunk", SHAPES)
def test_the_kernels_compute_the_eager_attention(kernels, monkeypatch, B, T, heads, dn, dv, r, dr, seq, chunk):
    monkeypatch.setattr(latent_attention, "CHUNK", chunk)
    q_nope, q_pe, w_kv, cache, slots, positions = inputs(B, T, heads, dn, dv, r, dr, seq)
    layer = 1
    out = latent_attention.latent_attention(q_nope, q_pe, w_kv, cache, layer * SLOTS + slots, positions, 0.3)
    assert kernels == [B * T]
    rows = cache[layer].index_select(0, slots)  # [B, seq, r + dr]
    expected = latent_attention.attend(*(t.float() for t in (q_nope, q_pe, w_kv, rows)), positions, 0.3)
    eager = latent_attention.attend(q_nope, q_pe, w_kv, rows, positions, 0.3)
    assert out.shape == (B, T, heads, dv) and out.dtype == torch.float16
    # Against float32: within twice eager float16's own error, which rounds at the same points.
    assert relative_error(out, expected) <= max(2 * relative_error(eager, expected), 1e-3)


def test_a_token_sees_only_the_positions_up_to_its_own(kernels):
    """Entries past a token's position (another token's future, stale or garbage) do not change its output."""
    q_nope, q_pe, w_kv, cache, slots, _ = inputs(1, 2, 4, 16, 8, 32, 16, 40)
    positions = torch.tensor([[5, 20]])
    rows = 1 * SLOTS + slots
    before = latent_attention.latent_attention(q_nope, q_pe, w_kv, cache, rows, positions, 0.3)
    cache[1, slots[0], 21:] = float("nan")
    after = latent_attention.latent_attention(q_nope, q_pe, w_kv, cache, rows, positions, 0.3)
    assert torch.equal(before, after)
    cache[1, slots[0], 6] = 0.0  # seen by the second token only
    changed = latent_attention.latent_attention(q_nope, q_pe, w_kv, cache, rows, positions, 0.3)
    assert torch.equal(changed[:, 0], before[:, 0]) and not torch.equal(changed[:, 1], before[:, 1])


@pytest.mark.parametrize("bound", ["MAX_TOKENS", "MAX_PARTIAL_BYTES"])
def test_calls_past_the_bounds_take_the_eager_ops(kernels, monkeypatch, bound):
    q_nope, q_pe, w_kv, cache, slots, positions = inputs(2, 3, 4, 16, 8, 32, 16, 40)
    chunks = -(-40 // latent_attention.CHUNK)
    monkeypatch.setattr(latent_attention, bound, 5 if bound == "MAX_TOKENS" else 6 * 4 * chunks * (32 + 2) * 4 - 1)
    out = latent_attention.latent_attention(q_nope, q_pe, w_kv, cache, 1 * SLOTS + slots, positions, 0.3)
    assert kernels == []
    rows = cache[1].index_select(0, slots)  # [B, seq, r + dr]
    assert torch.equal(out, latent_attention.attend(q_nope, q_pe, w_kv, rows, positions, 0.3))


@pytest.mark.parametrize("tokens", [1, 70])
def test_the_op_passes_opcheck(kernels, tokens):
    q_nope, q_pe, w_kv, cache, slots, positions = inputs(1, tokens, 2, 8, 8, 16, 8, 80)
    torch.library.opcheck(latent_attention.latent_attention, (q_nope, q_pe, w_kv, cache, SLOTS + slots, positions, 0.3))
    assert bool(kernels) == (tokens <= latent_attention.MAX_TOKENS)


def bundled_attention(dtype: torch.dtype) -> MLAttention:
    """An attention layer of the bundled model's shape (4 heads, rank 64, q_lora), random weights."""
    torch.manual_seed(0)
    attention = MLAttention(ModelConfig.from_checkpoint(BUNDLED)).to(dtype)
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return attention


def test_an_attention_layer_takes_the_kernels_for_its_decode_calls_once_turned_on(kernels):
    """Off by default (the eager ops); with `decode_kernel` True the layer's output through the kernels is its
    eager output within float16's rounding."""
    attention = bundled_attention(torch.float16)
    x = torch.randn(2, 1, 256, dtype=torch.float16)  # [B, T, H]
    positions, slots = torch.tensor([[7], [3]]), torch.tensor([0, 2])  # [B, T], [B]
    cos, sin = (torch.randn(2, 1, 16, dtype=torch.float16) for _ in range(2))  # [B, T, dr]
    cache = torch.randn(LAYERS, SLOTS, 16, 80, dtype=torch.float16)  # [L, S, seq, r + dr]
    with torch.no_grad():
        eager = attention(x, cos, sin, positions, slots, cache.clone(), 1)
        assert kernels == []
        attention.decode_kernel = True
        fused = attention(x, cos, sin, positions, slots, cache.clone(), 1)
        assert kernels == [2]
        expected = attention.float()(x.float(), cos.float(), sin.float(), positions, slots, cache.float(), 1)
    assert relative_error(fused, expected) <= max(2 * relative_error(eager, expected), 1e-3)


def test_a_compiled_attention_layer_takes_the_op_for_every_call(kernels, monkeypatch):
    """Under torch.compile(dynamic=True), as served: the layer compiles with the op inside (its fake result has the
    op's shape and strides), calls of few tokens take the kernels and a prefill the eager ops, as uncompiled."""
    monkeypatch.setattr(latent_attention, "MAX_TOKENS", 8)
    attention = bundled_attention(torch.float16)
    attention.decode_kernel = True
    cache = torch.zeros(LAYERS, SLOTS, 40, 80, dtype=torch.float16)  # [L, S, seq, r + dr]
    torch._dynamo.reset()
    compiled = torch.compile(attention, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for B, T, start in ((1, 20, 0), (1, 1, 20), (2, 1, 21), (1, 4, 21)):
            x = torch.randn(B, T, 256, dtype=torch.float16)  # [B, T, H]
            positions = start + torch.arange(T).expand(B, T)  # [B, T]
            slots = torch.arange(B)  # [B]
            cos, sin = (torch.randn(B, T, 16, dtype=torch.float16) for _ in range(2))  # [B, T, dr]
            expected = attention(x, cos, sin, positions, slots, cache.clone(), 1)
            del kernels[:]
            got = compiled(x, cos, sin, positions, slots, cache, 1)
            assert kernels == ([B * T] if B * T <= latent_attention.MAX_TOKENS else [])
            assert torch.allclose(got, expected, rtol=1e-2, atol=1e-3)
    torch._dynamo.reset()
