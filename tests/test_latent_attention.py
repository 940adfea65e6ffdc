"""The latent attention's decode kernels (export/latent_attention.py), run by Triton's interpreter on the CPU:
eager's attention over several chunks, rows independent of the call's other tokens, the dispatch inside one op
that passes opcheck (the model's steps with the kernels: tests/test_model.py)."""

from __future__ import annotations

import pytest
import torch

from triton_mtp.export import latent_attention as attention

pytest.importorskip("triton")

L, S, SEQ, R, DR, HEADS = 2, 3, 41, 32, 8, 4  # layers, slots, positions (the last one scratch), r, dr, heads


@pytest.fixture
def chunks(decode_kernels, monkeypatch):
    """Chunks of 16 positions read 4 at a time: the pool's 41 positions are three chunks, the last one partial,
    combined 2 at a time."""
    monkeypatch.setattr(attention, "CHUNK", 16)
    monkeypatch.setattr(attention, "BLOCK_S", 4)
    monkeypatch.setattr(attention, "STEP_C", 2)


def call(dtype: torch.dtype, B: int, T: int, seed: int = 0):
    """Random queries and pool, rows of pool layer 1, positions of every chunk, -1 padding among them."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(L, S, SEQ, R + DR, generator=g).to(dtype)  # [L, S, seq, r + dr]
    q_latent = torch.randn(B, T, HEADS, R, generator=g).to(dtype)  # [B, T, h, r]
    q_pe = torch.randn(B, T, HEADS, DR, generator=g).to(dtype)  # [B, T, h, dr]
    slot_ids = torch.arange(B) % S  # [B]
    positions = torch.randint(0, SEQ - 1, (B, T), generator=g)  # [B, T]
    positions[0, -1] = -1
    return q_latent, q_pe, cache, 1 * S + slot_ids, positions, cache[1].index_select(0, slot_ids)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# bf16: eager rounds the probabilities to bf16 and the kernels do not; the interpreter truncates its roundings.
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B, T", [(1, 1), (2, 3)])
def test_the_kernels_compute_eager_attention(chunks, dtype, tolerance, B, T):
    q_latent, q_pe, cache, rows, positions, kv = call(dtype, B, T)
    out = attention.latent_attention(q_latent, q_pe, cache, rows, positions, 0.3)  # [B, T, h, r]
    assert out.shape == q_latent.shape and out.dtype == dtype
    expected = attention.attend(q_latent.float(), q_pe.float(), kv.float(), positions, 0.3)  # [B, T, h, r]
    assert relative_error(out, expected) <= tolerance


def test_a_tokens_output_does_not_depend_on_the_other_tokens(chunks):
    q_latent, q_pe, cache, rows, positions, _ = call(torch.bfloat16, 2, 2)
    window = attention.latent_attention(q_latent, q_pe, cache, rows, positions, 0.3)  # [2, 2, h, r]
    for b in range(2):
        for t in range(2):
            one = attention.latent_attention(q_latent[b:b + 1, t:t + 1], q_pe[b:b + 1, t:t + 1], cache, rows[b:b + 1],
                                             positions[b:b + 1, t:t + 1], 0.3)  # [1, 1, h, r]
            assert torch.equal(window[b, t], one[0, 0])


def test_the_kernels_read_no_position_past_the_token(chunks):
    """Positions past a token's own (later tokens' entries, stale entries of a slot's earlier sequence, the scratch
    position) change nothing, even as NaN."""
    q_latent, q_pe, cache, rows, positions, _ = call(torch.float32, 1, 1)
    positions.fill_(20)  # the second chunk
    before = attention.latent_attention(q_latent, q_pe, cache, rows, positions, 0.3)
    cache[1, 0, 21:] = float("nan")
    assert torch.equal(attention.latent_attention(q_latent, q_pe, cache, rows, positions, 0.3), before)


def test_calls_past_the_bound_run_eager_attention(chunks, monkeypatch):
    monkeypatch.setattr(attention, "MAX_TOKENS", 4)
    q_latent, q_pe, cache, rows, positions, kv = call(torch.bfloat16, 1, 5)
    assert torch.equal(attention.latent_attention(q_latent, q_pe, cache, rows, positions, 0.3),
                       attention.attend(q_latent, q_pe, kv, positions, 0.3))


@pytest.mark.parametrize("T", [2, attention.MAX_TOKENS + 1])
def test_the_dispatch_op_passes_opcheck(chunks, T):
    q_latent, q_pe, cache, rows, positions, _ = call(torch.float32, 1, T)
    torch.library.opcheck(attention.latent_attention, (q_latent, q_pe, cache, rows, positions, 0.3))
