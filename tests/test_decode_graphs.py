"""Decode-graph wrappers (serving/graphs.py) on CPU: the padding to batch buckets and the verify
window, the graph families per MTP layer, the fallback to eager. `EagerReplay` stands in for the
CUDA graph (same static-input contract); the capture itself is `CapturedStep`, run on the H200 by
bench/standalone.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.graphs import export_graphs, load_step
from triton_mtp.serving.graphs import (
    EagerReplay, GraphedMTP, GraphedTarget, batch_buckets, graphs_wanted, with_decode_graphs,
)

MAX_SLOTS, MAX_SEQ_LEN, WIDTH = 6, 48, 4


@pytest.fixture()
def twins(drafting_checkpoint: Path):
    """Two copies of the same target + MTP: one called directly, one through the wrappers."""
    return [load_checkpoint(drafting_checkpoint, max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN, progress=False)
            for _ in range(2)]


def test_buckets_are_powers_of_two_then_the_largest_batch():
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(1) == [1]


def _window(rows: list[tuple[int, int, int]], vocab: int, gen: torch.Generator):
    """(slot, first position, length) per row -> token_ids, positions [B, T] padded with -1, slot_ids [B]."""
    T = max(length for _, _, length in rows)
    token_ids = torch.randint(2, vocab, (len(rows), T), generator=gen)  # [B, T]
    positions = torch.full((len(rows), T), -1)  # [B, T]
    for b, (_, start, length) in enumerate(rows):
        positions[b, :length] = torch.arange(start, start + length)
    return token_ids, positions, torch.tensor([slot for slot, _, _ in rows])


def test_graphed_target_equals_the_step_through_prefill_decode_and_rollback(twins):
    (config, plain, _), (_, wrapped, _) = twins
    graphed = GraphedTarget(wrapped, MAX_SLOTS, WIDTH, torch.device("cpu"), graph=EagerReplay)
    assert sorted(graphed.graphs) == [(None, b) for b in (1, 2, 4, 6)]
    gen = torch.Generator().manual_seed(0)
    calls = [
        [(0, 0, 9), (3, 0, 5)],  # prefill: wider than the window, eager
        [(0, 9, 1), (3, 5, 4)],  # decode + verify window: bucket 2
        [(0, 10, 4), (3, 7, 2), (5, 0, 3)],  # 3 rows padded to bucket 4; slot 3 rolls back to 7
        [(1, 0, 2)],  # bucket 1
        [(s, 12, 1) for s in range(MAX_SLOTS)],  # every slot: the largest bucket
    ]
    for rows in calls:
        inputs = _window(rows, config.vocab_size, gen)
        expected = plain(*inputs)
        got = graphed(*inputs)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    live = plain.kv_cache[:, :, :-1]  # the scratch position differs: padding writes it
    torch.testing.assert_close(wrapped.kv_cache[:, :, :-1], live, rtol=0, atol=1e-5)


def test_graphed_mtp_equals_the_step_per_layer(twins):
    (config, _, plain), (_, _, wrapped) = twins
    layers = config.num_nextn_predict_layers
    graphed = GraphedMTP(wrapped, layers, MAX_SLOTS, WIDTH, config.hidden_size, torch.float32,
                         torch.device("cpu"), graph=EagerReplay)
    assert len(graphed.graphs) == layers * len(batch_buckets(MAX_SLOTS))
    gen = torch.Generator().manual_seed(1)
    for step, rows in enumerate([[(0, 0, 7), (2, 0, 3)], [(0, 7, 2), (2, 3, 4)], [(0, 9, 1), (2, 7, 1), (4, 0, 2)]]):
        for layer in range(layers + 1):  # layer index `layers` reuses layer 0
            token_ids, positions, slots = _window(rows, config.vocab_size, gen)
            hidden = torch.randn(*token_ids.shape, config.hidden_size, generator=gen)  # [B, T, H]
            expected = plain(token_ids, hidden, positions, slots, layer)
            got = graphed(token_ids, hidden, positions, slots, layer)
            for e, g in zip(expected, got):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_graphed_eager_format_runners_equal_the_plain_runners(twins, drafting_checkpoint, tmp_path):
    """The served path: `load_step` runners (eager format, uncompiled, their own KV pools) behind the wrappers."""
    (config, target, mtp), _ = twins
    export_graphs(target, mtp, tmp_path, "eager", checkpoint_dir=drafting_checkpoint, dtype="fp32", eager_compile=False)

    def runner(name: str):
        return load_step(tmp_path / f"{name}.json", "eager")

    plain_target, plain_mtp = runner("target"), runner("mtp_0")
    cpu = torch.device("cpu")
    graphed_target = GraphedTarget(runner("target"), MAX_SLOTS, WIDTH, cpu, graph=EagerReplay)
    graphed_mtp = GraphedMTP(runner("mtp_0"), config.num_nextn_predict_layers, MAX_SLOTS, WIDTH, config.hidden_size,
                             torch.float32, cpu, graph=EagerReplay)
    gen = torch.Generator().manual_seed(2)
    for rows in ([(0, 0, 6), (4, 0, 8)], [(0, 6, 3), (4, 8, 1)], [(0, 9, 2), (1, 0, 1), (4, 9, 4)]):
        inputs = _window(rows, config.vocab_size, gen)
        for e, g in zip(plain_target(*inputs), graphed_target(*inputs)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        hidden = torch.randn(*inputs[0].shape, config.hidden_size, generator=gen)  # [B, T, H]
        for layer in range(config.num_nextn_predict_layers):
            expected = plain_mtp(inputs[0], hidden, inputs[1], inputs[2], layer)
            got = graphed_mtp(inputs[0], hidden, inputs[1], inputs[2], layer)
            for e, g in zip(expected, got):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


class Broken(EagerReplay):
    """A replay whose logits are wrong, as a capture gone bad would give."""

    def replay(self):
        logits, hidden = super().replay()
        return logits + 1.0, hidden


class Stale(EagerReplay):
    """A replay that returns what the capture-time run gave, as a graph that captured no kernels would."""

    def __init__(self, step, example_inputs, pool=None) -> None:
        super().__init__(step, example_inputs, pool)
        self.outputs = tuple(x.clone() for x in super().replay())

    def replay(self):
        return self.outputs


def test_a_graph_that_captured_nothing_is_caught(twins):
    (_, target, _), _ = twins
    lines = []
    step = with_decode_graphs(lambda: GraphedTarget(target, 2, WIDTH, torch.device("cpu"), graph=Stale),
                              target, lines.append)
    assert step is target and "differs from eager" in lines[0]


def test_a_graph_that_disagrees_with_eager_falls_back_to_the_step(twins):
    (_, target, _), _ = twins
    lines = []
    step = with_decode_graphs(lambda: GraphedTarget(target, 2, WIDTH, torch.device("cpu"), graph=Broken),
                              target, lines.append)
    assert step is target
    assert lines and lines[0].startswith("CUDA graphs off, running eager: RuntimeError: CUDA graph of target (batch 2) differs")
    lines.clear()
    step = with_decode_graphs(lambda: GraphedTarget(target, 2, WIDTH, torch.device("cpu"), graph=EagerReplay),
                              target, lines.append)
    assert isinstance(step, GraphedTarget) and lines == ["CUDA graphs captured for batch sizes [1, 2] x 4 tokens"]


def test_graphs_are_wanted_on_cuda_for_capturable_formats_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = {"cuda_graphs": "true"}
    assert not graphs_wanted({"format": "torchscript", **on}, cuda, 1)  # its steps synchronize with the host
    assert graphs_wanted({"format": "eager", **on}, cuda, 1)
    assert not graphs_wanted({"format": "eager", "cuda_graphs": "false"}, cuda, 1)
    assert not graphs_wanted({"format": "eager"}, cuda, 1)  # a repository from before the parameter
    assert not graphs_wanted({"format": "onnx", **on}, cuda, 1)
    assert not graphs_wanted({"format": "eager", **on}, cpu, 1)
    assert not graphs_wanted({"format": "eager", **on}, cuda, 2)
    with pytest.raises(ValueError, match="parameter 'cuda_graphs' must be true or false"):
        graphs_wanted({"format": "eager", "cuda_graphs": "yes"}, cuda, 1)
