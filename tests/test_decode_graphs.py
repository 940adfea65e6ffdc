"""Decode-graph wrappers (serving/graphs.py) on CPU: the padding to batch buckets and the verify
window, the graph families per MTP layer and per draft count, the fallback to eager, and the engine
over graphed workers. `EagerReplay` stands in for the CUDA graph (same static-input contract); the
capture itself is `CapturedStep`, run on the H200 by bench/standalone.py and bench/engine_overhead.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.graphs import export_graphs, load_step
from triton_mtp.serving.graphs import (
    EagerReplay, GraphedChain, GraphedDraftChain, GraphedMTP, GraphedSteps, GraphedTarget, batch_buckets, chain_graphs,
    compile_graphs, draft_chain_graphs, graphs_wanted, mtp_graphs, prefill_widths, steps_graphs, target_graphs,
    with_decode_graphs,
)
from triton_mtp.serving.requests import GenerationRequest, in_process_limits
from triton_mtp.serving.scheduler import FinalResponse, Scheduler
from triton_mtp.serving.workers import (
    DraftWorker, InProcessHops, TargetBatch, TargetWorker, draft_chain, multi_step, split_window_results, verify_window,
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


def _window(rows: list[tuple], vocab: int, gen: torch.Generator):
    """(slot, first position, length[, drafts]) per row -> token_ids, positions [B, T] padded with -1,
    slot_ids [B] (and num_draft [B] when the rows give drafts)."""
    T = max(row[2] for row in rows)
    token_ids = torch.randint(2, vocab, (len(rows), T), generator=gen)  # [B, T]
    positions = torch.full((len(rows), T), -1)  # [B, T]
    for b, (_, start, length, *_) in enumerate(rows):
        positions[b, :length] = torch.arange(start, start + length)
    inputs = [token_ids, positions, torch.tensor([row[0] for row in rows])]
    if len(rows[0]) == 4:
        inputs.append(torch.tensor([row[3] for row in rows]))
    return inputs


class _CountedReplay(EagerReplay):
    def replay(self) -> tuple[torch.Tensor, ...]:
        self.replays = getattr(self, "replays", 0) + 1
        return super().replay()


def _assert_calls_match(graphed: GraphedTarget, plain, wrapped, calls: list[list[tuple]], vocab: int) -> None:
    """Each call's outputs through `graphed` (over `wrapped`) equal `verify_window(plain)`'s, and so do the KV
    caches after them."""
    gen = torch.Generator().manual_seed(0)
    for rows in calls:
        inputs = _window(rows, vocab, gen)
        K = int(inputs[3].max())
        *expected, expected_results = verify_window(plain)(*inputs, K)
        *got, results = graphed(*inputs, K)
        for n, (e, g) in enumerate(zip(expected, got)):
            assert g.shape == e.shape
            if n < 2:  # window_logits, draft_ids: a row's columns past its own drafts are padding
                for b, k in enumerate(inputs[3].tolist()):
                    torch.testing.assert_close(g[b, : k + 1 - n], e[b, : k + 1 - n], rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        # the results tensor is as wide as the graph's window (padding past K + 1), the same results in it
        for e, g in zip(split_window_results(expected_results.numpy(), K + 1).values(),
                        split_window_results(results.numpy(), K + 1).values()):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    live = plain.kv_cache[:, :, :-1]  # the scratch position differs: padding writes it
    torch.testing.assert_close(wrapped.kv_cache[:, :, :-1], live, rtol=0, atol=1e-5)


def test_graphed_target_equals_the_window_step_through_prefill_decode_and_rollback(twins):
    """One-token calls (plain decoding) replay the one-token family, wider ones the window's."""
    (config, plain, _), (_, wrapped, _) = twins
    graphed = GraphedTarget(verify_window(wrapped), MAX_SLOTS, WIDTH, torch.device("cpu"), graph=_CountedReplay)
    assert sorted(graphed.graphs) == [(w, b) for w in (1, WIDTH) for b in (1, 2, 4, 6)]
    _assert_calls_match(graphed, plain, wrapped, [
        [(0, 0, 9, 0), (3, 0, 5, 0)],  # prefill: wider than the window, eager
        [(0, 9, 1, 0), (3, 5, 4, 3)],  # decode + verify window: bucket 2
        [(0, 10, 4, 3), (3, 7, 2, 1), (5, 0, 3, 0)],  # 3 rows padded to bucket 4; slot 3 rolls back to 7
        [(1, 0, 2, 1)],  # bucket 1
        [(s, 12, 1, 0) for s in range(MAX_SLOTS)],  # every slot: the largest bucket, plain decoding
        [(2, 13, 1, 0), (4, 13, 1, 0), (5, 13, 1, 0)],  # plain decoding padded to bucket 4
    ], config.vocab_size)
    replays = {key: getattr(g, "replays", 0) for key, g in graphed.graphs.items()}
    assert replays == {**{key: 0 for key in graphed.graphs}, (WIDTH, 2): 1, (WIDTH, 4): 1, (WIDTH, 1): 1,
                       (1, 6): 1, (1, 4): 1}


def test_prompt_widths_are_powers_of_two_from_16_past_the_window_within_the_budget():
    assert prefill_widths(5, 256) == [16, 32, 64, 128, 256]
    assert prefill_widths(5, 100) == [16, 32, 64]
    assert prefill_widths(20, 64) == [32, 64]
    assert prefill_widths(5, 15) == prefill_widths(5, 0) == []


def test_a_call_replays_the_narrowest_family_whose_padded_rows_fit():
    graphed = GraphedTarget(lambda *inputs: None, MAX_SLOTS, WIDTH, torch.device("cpu"), graph=EagerReplay,
                            prefill_tokens=56)  # 16 tokens: buckets 1 and 2 (4 x 16 > 56); 32 tokens: bucket 1
    assert [graphed.family(B, T) for B, T in [(6, 1), (7, 1), (6, 4), (2, 9), (3, 9), (1, 17), (2, 17), (1, 33)]] == \
        [1, None, WIDTH, 16, None, 32, None, None]


def test_prompt_calls_replay_the_prompt_families_that_fit_their_token_budget(twins):
    """With `prefill_tokens`, a prompt call of B rows of T tokens replays the narrowest family of width P >= T
    whose B-row bucket keeps B·P within the budget; wider or larger calls run eager."""
    (config, plain, _), (_, wrapped, _) = twins
    graphed = GraphedTarget(verify_window(wrapped), MAX_SLOTS, WIDTH, torch.device("cpu"), graph=_CountedReplay,
                            prefill_tokens=40)
    assert sorted(key for key in graphed.graphs if key[0] > WIDTH) == [(16, 1), (16, 2), (32, 1)]
    _assert_calls_match(graphed, plain, wrapped, [
        [(0, 0, 9, 0), (3, 0, 5, 0)],  # two prompts of <= 16 tokens: (16, 2)
        [(1, 0, 20, 0)],  # one of 20 tokens: (32, 1)
        [(2, 0, 9, 0), (4, 0, 3, 0), (5, 0, 7, 0)],  # three: 3 x 16 > 40 tokens, eager
        [(0, 9, 1, 0), (3, 5, 4, 3)],  # decoding: the window's family
        [(1, 20, 3, 2), (5, 0, 12, 0)],  # a prompt beside a verify window (prompts not apart): (16, 2), K = 2
        [(4, 3, 40, 0)],  # wider than every family: eager
        [(2, 3, 12, 5)],  # more drafts than the window's: a prompt family would cut them, eager
    ], config.vocab_size)
    replays = {key: g.replays for key, g in graphed.graphs.items() if hasattr(g, "replays")}
    assert replays == {(16, 2): 2, (32, 1): 1, (WIDTH, 2): 1}
    lines = []
    with_decode_graphs(lambda: graphed, None, lines.append)
    assert lines == ["CUDA graphs of target captured for batch sizes [1, 2, 4, 6] x 1 and 4 tokens; "
                     "prompts of up to 32 tokens, 40 a call"]


def test_graphed_draft_chain_equals_the_chain_for_every_draft_count(twins):
    (config, _, plain), (_, _, wrapped) = twins
    layers, H = config.num_nextn_predict_layers, config.hidden_size
    max_draft = 4
    fallback_calls = []

    def fallback(*inputs):
        fallback_calls.append(inputs[-1])
        return draft_chain(wrapped, layers, *inputs)

    graphed = GraphedDraftChain(lambda *inputs: draft_chain(wrapped, layers, *inputs), fallback, max_draft, MAX_SLOTS,
                                WIDTH, H, torch.float32, torch.device("cpu"), graph=EagerReplay)
    assert sorted(graphed.graphs) == [(k, b) for k in range(1, max_draft + 1) for b in (1, 2, 4, 6)]
    gen = torch.Generator().manual_seed(3)
    calls = [
        ([(0, 0, 7, 3), (2, 0, 3, 2)], 3),  # prompt absorption: wider than the window, the fallback
        ([(0, 7, 2, 4), (2, 3, 4, 1)], 4),  # each row its own draft count
        ([(0, 9, 1, 1), (2, 4, 1, 1), (4, 0, 2, 1)], 1),  # 3 rows padded to bucket 4
        ([(0, 10, 3, 2)], 2),
        ([(0, 13, 1, 5)], 5),  # more drafts than any graph: the fallback
    ]
    for rows, K in calls:
        token_ids, positions, slots, num_draft = _window(rows, config.vocab_size, gen)
        hidden = torch.randn(*token_ids.shape, H, generator=gen)  # [B, T, H]
        expected = draft_chain(plain, layers, token_ids, hidden, positions, slots, num_draft, K)
        got = graphed(token_ids, hidden, positions, slots, num_draft, K)
        assert torch.equal(got, expected) and got.shape == (len(rows), K)
    assert fallback_calls == [3, 5]
    torch.testing.assert_close(wrapped.kv_cache[:, :, :-1], plain.kv_cache[:, :, :-1], rtol=0, atol=1e-5)  # all but scratch


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

    plain_target, plain_mtp = verify_window(runner("target")), runner("mtp_0")
    cpu = torch.device("cpu")
    graphed_target = GraphedTarget(verify_window(runner("target")), MAX_SLOTS, WIDTH, cpu, graph=EagerReplay)
    graphed_mtp = GraphedMTP(runner("mtp_0"), config.num_nextn_predict_layers, MAX_SLOTS, WIDTH, config.hidden_size,
                             torch.float32, cpu, graph=EagerReplay)
    gen = torch.Generator().manual_seed(2)
    for rows in ([(0, 0, 6, 0), (4, 0, 8, 0)], [(0, 6, 3, 2), (4, 8, 1, 0)], [(0, 9, 2, 1), (1, 0, 1, 0), (4, 9, 4, 3)]):
        inputs = _window(rows, config.vocab_size, gen)
        K = int(inputs[3].max())
        for e, g in zip(plain_target(*inputs, K)[:-1], graphed_target(*inputs, K)[:-1]):  # results: the test above
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        hidden = torch.randn(*inputs[0].shape, config.hidden_size, generator=gen)  # [B, T, H]
        for layer in range(config.num_nextn_predict_layers):
            expected = plain_mtp(inputs[0], hidden, inputs[1], inputs[2], layer)
            got = graphed_mtp(inputs[0], hidden, inputs[1], inputs[2], layer)
            for e, g in zip(expected, got):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


class BufferedReplay(EagerReplay):
    """`EagerReplay` whose outputs, like a CUDA graph's, live in buffers that every replay overwrites: a
    caller that reads a result after the next replay reads the wrong values."""

    _buffers = None

    def replay(self):
        outputs = super().replay()
        if self._buffers is None:
            self._buffers = tuple(torch.empty_like(x) for x in outputs)
        for buffer, x in zip(self._buffers, outputs):
            buffer.copy_(x)
        self.outputs = self._buffers
        return self.outputs


class _CountedBufferedReplay(BufferedReplay):
    replays = 0

    def replay(self):
        type(self).replays += 1
        return super().replay()


class _RecordedDrafts:
    """A hops object's mtp call that keeps what each call absorbed (tokens, hidden states) and drafted."""

    def __init__(self, mtp) -> None:
        self.mtp, self.calls = mtp, []

    def __call__(self, batch):
        result = self.mtp(batch)
        self.calls.append((batch.token_ids.tolist(), batch.hidden.clone(), result.draft_ids.tolist()))
        return result


@pytest.mark.parametrize("num_draft_tokens, temperature, spec_disable_rows",
                         [(0, 0.0, 0), (1, 0.0, 0), (3, 0.0, 0), (2, 0.8, 0), (3, 0.0, 2), (2, 0.8, 2)])
def test_the_engine_over_graphed_workers_emits_what_it_emits_eager(drafting_checkpoint, num_draft_tokens, temperature,
                                                                    spec_disable_rows):
    """Tokens, logprobs and drafts of the scheduler over graphed workers (outputs in replay-owned buffers)
    equal the eager workers', greedy and seeded sampling, for rows joining, drafting and finishing at
    different steps (prompt calls of up to 32 tokens replay the prompt graphs, larger ones run eager, the rest
    replay). With `spec_disable_rows` 2, the target
    hidden states that wait through steps without drafts outlive the replays that made them."""
    slots, max_draft = 4, 3
    outputs, drafts = [], []
    _CountedBufferedReplay.replays = 0
    for mode in ("eager", "graphed", "chain graphed"):
        config, target, mtp = load_checkpoint(drafting_checkpoint, max_slots=slots, max_seq_len=MAX_SEQ_LEN,
                                              progress=False)
        layers, H, cpu = config.num_nextn_predict_layers, config.hidden_size, torch.device("cpu")
        window, mtp_step, greedy, chained = verify_window(target), mtp, None, None
        if mode != "eager":
            window = target_graphs(target, slots, max_draft, cpu, graph=BufferedReplay, prefill_tokens=32)  # as served
            mtp_step = mtp_graphs(mtp, layers, slots, max_draft, H, torch.float32, cpu, graph=BufferedReplay)
            greedy = draft_chain_graphs(mtp, mtp_step, max_draft, graph=BufferedReplay)
        if mode == "chain graphed":
            chained = chain_graphs(window, mtp, mtp_step, graph=_CountedBufferedReplay)
        hops = InProcessHops(TargetWorker(window, slots), DraftWorker(mtp_step, layers, slots, greedy=greedy), chained)
        limits = in_process_limits(config.vocab_size, slots, MAX_SEQ_LEN, max_draft, max_queue_size=8)
        engine = Scheduler(hops, limits, spec_disable_rows=spec_disable_rows)
        hops.mtp = _RecordedDrafts(hops.mtp)
        handles = [FinalResponse() for _ in range(6)]
        gen = torch.Generator().manual_seed(4)
        for n, handle in enumerate(handles):
            prompt = torch.randint(2, config.vocab_size, (3 + 2 * n,), generator=gen).tolist()
            engine.submit(GenerationRequest(input_ids=prompt, max_tokens=5 + 3 * n, num_draft_tokens=num_draft_tokens,
                                            temperature=temperature, seed=7 + n, return_logprobs=True), handle)
        engine.run_until_idle()
        assert [h.error for h in handles] == [None] * len(handles)
        if mode != "eager":  # rows admitted later prefilled in a prompt graph
            assert any(g._buffers is not None for (width, _), g in window.graphs.items() if width > max_draft + 1)
        outputs.append([(h.final.output_ids, h.final.logprobs) for h in handles])
        drafts.append(hops.mtp.calls)
    chains = num_draft_tokens and temperature == 0  # (with spec_disable_rows 2: once two rows are left)
    assert (_CountedBufferedReplay.replays > 0) == bool(chains)  # chained steps replayed the chain's graphs
    for graphed in (1, 2):
        assert len(drafts[graphed]) == len(drafts[0])
        for (graphed_ids, graphed_hidden, graphed_drafts), (eager_ids, eager_hidden, eager_drafts) in zip(
                drafts[graphed], drafts[0]):
            assert (graphed_ids, graphed_drafts) == (eager_ids, eager_drafts)
            torch.testing.assert_close(graphed_hidden, eager_hidden)
        for (eager_ids, eager_logprobs), (graphed_ids, graphed_logprobs) in zip(outputs[0], outputs[graphed]):
            assert graphed_ids == eager_ids
            assert graphed_logprobs == pytest.approx(eager_logprobs, abs=1e-5)


@pytest.mark.parametrize("prompt_tokens", [10, 1])
def test_a_request_admitted_while_calls_go_ahead_leaves_the_decoding_rows_tokens_alone(drafting_checkpoint,
                                                                                       prompt_tokens):
    """A request that arrives while a row decodes is admitted on the way: its prompt's call is launched before the
    next decode call, and may replay the graph whose output buffer holds the decoding row's next input (a prompt
    of 10 tokens arriving while the first one's prompt call is launched: the same prompt family; a prompt of one
    token while the first row decodes: the same one-token graph). Both rows emit what they emit one call at a time
    over eager workers."""
    slots, max_draft = 4, 3
    outputs = []
    for graphed in (False, True):
        config, target, mtp = load_checkpoint(drafting_checkpoint, max_slots=slots, max_seq_len=MAX_SEQ_LEN,
                                              progress=False)
        window = (target_graphs(target, slots, max_draft, torch.device("cpu"), graph=BufferedReplay, prefill_tokens=32)
                  if graphed else verify_window(target))
        hops = InProcessHops(TargetWorker(window, slots), DraftWorker(mtp, config.num_nextn_predict_layers, slots))
        engine = Scheduler(hops, in_process_limits(config.vocab_size, slots, MAX_SEQ_LEN, max_draft, max_queue_size=8),
                           overlap=graphed)
        gen = torch.Generator().manual_seed(1)
        first, second = (GenerationRequest(torch.randint(2, config.vocab_size, (n,), generator=gen).tolist(), 8)
                         for n in (10, prompt_tokens))
        handles = FinalResponse(), FinalResponse()
        launch = hops.launch_target

        def launch_then_submit(batch, *args):  # the second request arrives as the first call goes out
            hops.launch_target = launch
            pending = launch(batch, *args)
            engine.submit(second, handles[1])
            return pending

        if prompt_tokens > 1:
            hops.launch_target = launch_then_submit
        engine.submit(first, handles[0])
        if prompt_tokens == 1:
            engine.step()
            engine.step()
            engine.submit(second, handles[1])
        engine.run_until_idle()
        outputs.append([h.final.output_ids for h in handles])
    assert outputs[1] == outputs[0]


class _PairsByPosition:
    """A hops object's mtp call that keeps, per absorbed position, the MTP pair (token, hidden state) and, per position
    drafted after, the drafts (one speculative request: a position is its own)."""

    def __init__(self, mtp) -> None:
        self.mtp, self.pairs, self.drafts = mtp, {}, {}

    def __call__(self, batch):
        result = self.mtp(batch)
        for b, (positions, k) in enumerate(zip(batch.positions.tolist(), batch.num_draft.tolist())):
            for j, position in enumerate(positions):
                if position >= 0:
                    self.pairs[position] = (int(batch.token_ids[b, j]), batch.hidden[b, j].clone())
            self.drafts[max(positions)] = result.draft_ids[b, :k].tolist()
        return result


def _serve_steps(checkpoint: Path, decode_steps: int, steps_kind: str | None, overlap: bool, eos: int):
    """Outputs (ids, logprobs, finish reason) of the requests below, served with `decode_steps` (`steps_kind`: None,
    eager; "graphs", `GraphedSteps` over the target's graphs; "replays", `multi_step` over them: N replays of the
    one-token graph, whose buffers each replay overwrites), each target call's (steps, last position of its input),
    and the speculative row's MTP pairs and drafts by position."""
    slots, max_draft = 4, 3
    config, target, mtp = load_checkpoint(checkpoint, max_slots=slots, max_seq_len=MAX_SEQ_LEN, progress=False)
    window, steps = verify_window(target), None
    if steps_kind:
        window = target_graphs(target, slots, max_draft, torch.device("cpu"), graph=BufferedReplay, prefill_tokens=32)
        steps = (steps_graphs(window, target, decode_steps, graph=BufferedReplay) if steps_kind == "graphs"
                 else multi_step(window, decode_steps))
    hops = InProcessHops(TargetWorker(window, slots, decode_steps=decode_steps, steps=steps),
                         DraftWorker(mtp, config.num_nextn_predict_layers, slots))
    hops.mtp = _PairsByPosition(hops.mtp)
    launch, launched = hops.launch_target, []

    def counted(batch, hidden=True, steps=1):
        launched.append((steps, int(batch.positions.max())))
        return launch(batch, hidden, steps)

    hops.launch_target = counted
    limits = in_process_limits(config.vocab_size, slots, MAX_SEQ_LEN, max_draft, max_queue_size=8, eos_token_id=eos)
    engine = Scheduler(hops, limits, spec_disable_rows=2, overlap=overlap)
    gen = torch.Generator().manual_seed(5)
    requests = [GenerationRequest(torch.randint(2, config.vocab_size, (n,), generator=gen).tolist(), max_tokens,
                                  return_logprobs=True, **extra)
                for n, max_tokens, extra in ((5, 13, {}), (3, 1, {}), (7, 2, {}), (4, 20, {"num_draft_tokens": 2}),
                                             (MAX_SEQ_LEN - 11, 11, {}), (6, 4, {"temperature": 0.8, "seed": 3}),
                                             (2, 9, {}))]
    handles = [FinalResponse() for _ in requests]
    for request, handle in list(zip(requests, handles))[:4]:
        engine.submit(request, handle)
    for _ in range(3):
        engine.step()
    for request, handle in list(zip(requests, handles))[4:]:  # arriving while calls go ahead
        engine.submit(request, handle)
    engine.run_until_idle()
    assert [h.error for h in handles] == [None] * len(handles)
    assert engine.slots.num_free == slots
    outputs = [(h.final.output_ids, h.final.logprobs, h.final.finish_reason) for h in handles]
    return outputs, launched, hops.mtp


def test_a_multi_step_call_takes_greedy_one_token_rows_without_drafts_only(twins):
    (config, target, _), _ = twins
    with pytest.raises(ValueError, match="decode_steps: must be >= 1, got 0"):
        TargetWorker(verify_window(target), MAX_SLOTS, decode_steps=0)
    worker = TargetWorker(verify_window(target), MAX_SLOTS, decode_steps=2)
    one_token = dict(token_ids=torch.tensor([[5], [6]]), positions=torch.tensor([[0], [0]]),
                     slot_ids=torch.tensor([0, 1]), num_draft=torch.tensor([0, 0]))
    knobs = dict(top_k=torch.zeros(2, dtype=torch.int64), top_p=torch.ones(2), seeds=torch.zeros(2, dtype=torch.int64),
                 new=torch.ones(2, dtype=torch.bool))
    result, _, _ = worker.launch(TargetBatch(temperature=torch.zeros(2), **knobs, **one_token), steps=2)
    assert result.output_ids.shape == (2, 2) and result.num_accepted.tolist() == [1, 1]
    window = dict(one_token, token_ids=torch.tensor([[5, 7], [6, 8]]), positions=torch.tensor([[1, 2], [1, 2]]),
                  num_draft=torch.tensor([1, 1]))
    for steps, batch in ((2, TargetBatch(temperature=torch.tensor([0.0, 0.8]), **knobs, **one_token)),
                         (2, TargetBatch(temperature=torch.zeros(2), **knobs, **window)),
                         (3, TargetBatch(temperature=torch.zeros(2), **knobs, **one_token))):
        with pytest.raises(ValueError, match="decode_steps: a call runs 1 step, or 2 over greedy one-token rows"):
            worker.launch(batch, steps)


@pytest.mark.parametrize("overlap", [True, False])
def test_multi_step_decoding_emits_what_one_step_a_call_emits(drafting_checkpoint, overlap):
    """With `decode_steps` N, calls over greedy rows without drafts run N target steps (eager: `multi_step`; graphed:
    `GraphedSteps`, or N replays of the one-token graph, whose buffers every replay overwrites), and the engine emits
    the tokens and logprobs of one step a call: rows finishing mid-call (max_tokens 1 and 2, an EOS), a row whose
    last tokens reach max_seq_len (no call writes past it: calls there run one step), a sampled row (calls with it
    run one step), requests arriving while calls go ahead, and a speculative row whose MTP pairs wait through
    multi-step calls (drafting off above 2 rows): the pairs it absorbs, and the drafts after them, are those of one
    step a call."""
    (probe, *_), _, _ = _serve_steps(drafting_checkpoint, 1, None, overlap, -1)
    eos = probe[0][6]  # the first request stops on its seventh token
    expected, one_step, expected_mtp = _serve_steps(drafting_checkpoint, 1, None, overlap, eos)
    assert expected[0][2] == "stop" and len(expected[0][0]) < 7 and {n for n, _ in one_step} == {1}
    for decode_steps, steps_kind in ((3, None), (2, "graphs"), (4, "graphs"), (3, "replays")):
        outputs, launched, mtp = _serve_steps(drafting_checkpoint, decode_steps, steps_kind, overlap, eos)
        for (ids, logprobs, reason), (expected_ids, expected_logprobs, expected_reason) in zip(outputs, expected):
            assert (ids, reason) == (expected_ids, expected_reason)
            assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)
        assert [n for n, _ in launched].count(decode_steps) > 0 and len(launched) < len(one_step)
        assert all(last + n <= MAX_SEQ_LEN for n, last in launched)  # the KV positions each call writes
        # drafting resumes once two rows are left, which may come after the row's last call: compared where both
        # absorbed, past the pairs of its 4-token prompt (positions 0-3) and those of a multi-step call after it
        common = mtp.pairs.keys() & expected_mtp.pairs.keys()
        assert max(common) >= 3 + decode_steps
        for position in common:
            (token, hidden), (expected_token, expected_hidden) = mtp.pairs[position], expected_mtp.pairs[position]
            assert token == expected_token, position
            torch.testing.assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
        assert all(mtp.drafts[p] == expected_mtp.drafts[p] for p in mtp.drafts.keys() & expected_mtp.drafts.keys())


class Broken(EagerReplay):
    """A replay whose logits are wrong, as a capture gone bad would give."""

    def replay(self):
        logits, *rest = super().replay()
        return logits + 1.0, *rest


class Stale(EagerReplay):
    """A replay that returns what the capture-time run gave, as a graph that captured no kernels would."""

    def __init__(self, step, example_inputs, pool=None) -> None:
        super().__init__(step, example_inputs, pool)
        self.outputs = tuple(x.clone() for x in super().replay())

    def replay(self):
        return self.outputs


def test_a_graph_that_captured_nothing_is_caught(twins):
    (config, target, mtp), _ = twins
    lines = []
    window = verify_window(target)
    step = with_decode_graphs(lambda: GraphedTarget(window, 2, WIDTH, torch.device("cpu"), graph=Stale),
                              window, lines.append)
    assert step is window and "differs from eager" in lines[0]

    def chain(*inputs):
        return draft_chain(mtp, config.num_nextn_predict_layers, *inputs)

    step = with_decode_graphs(lambda: GraphedDraftChain(chain, chain, 2, 2, WIDTH, config.hidden_size, torch.float32,
                                                        torch.device("cpu"), graph=Stale), chain, lines.append)
    assert step is chain and "drafting chain" in lines[1] and "ids differ" in lines[1]

    cpu = torch.device("cpu")
    layers, H = config.num_nextn_predict_layers, config.hidden_size
    mtp_step = GraphedMTP(mtp, layers, 2, WIDTH, H, torch.float32, cpu, graph=EagerReplay)
    graphed = GraphedTarget(window, 2, WIDTH, cpu, graph=EagerReplay)
    step = with_decode_graphs(lambda: chain_graphs(graphed, mtp, mtp_step, graph=Stale), None, lines.append)
    assert step is None and "chained drafting" in lines[2] and "differs from eager" in lines[2]
    step = with_decode_graphs(lambda: chain_graphs(graphed, mtp, mtp_step, graph=EagerReplay), None, lines.append)
    assert isinstance(step, GraphedChain) and sorted(step.graphs) == [(K, b) for K in (1, 2, 3) for b in (1, 2)]
    step = with_decode_graphs(lambda: steps_graphs(graphed, target, 2, graph=Stale), None, lines.append)
    assert step is None and "the 2-step target" in lines[4] and "differs from eager" in lines[4]
    step = with_decode_graphs(lambda: steps_graphs(graphed, target, 2, graph=EagerReplay), None, lines.append)
    assert isinstance(step, GraphedSteps) and sorted(step.graphs) == [(2, 1), (2, 2)]


def test_a_graph_that_disagrees_with_eager_falls_back_to_the_step(twins):
    (_, target, _), _ = twins
    lines = []
    window = verify_window(target)
    step = with_decode_graphs(lambda: GraphedTarget(window, 2, WIDTH, torch.device("cpu"), graph=Broken),
                              window, lines.append)
    assert step is window
    assert lines and lines[0].startswith(
        "CUDA graphs off, running eager: GraphMismatch: CUDA graph of the 4-token target (batch 2) differs")
    lines.clear()
    step = with_decode_graphs(lambda: GraphedTarget(window, 2, WIDTH, torch.device("cpu"), graph=EagerReplay),
                              window, lines.append)
    assert isinstance(step, GraphedTarget) and lines == ["CUDA graphs of target captured for batch sizes [1, 2] x 1 and 4 tokens"]


class BrokenPrompts(EagerReplay):
    """`Broken` for the prompt families' graphs (wider than the window) only."""

    def replay(self):
        logits, *rest = super().replay()
        return (logits + 1.0 if self.inputs[0].shape[1] > WIDTH else logits), *rest


def test_prompt_graphs_that_disagree_with_eager_are_dropped_and_the_decode_graphs_kept(twins):
    (config, plain, _), (_, wrapped, _) = twins
    lines = []
    step = with_decode_graphs(lambda: GraphedTarget(verify_window(wrapped), 2, WIDTH, torch.device("cpu"),
                                                    graph=BrokenPrompts, prefill_tokens=32), None, lines.append)
    assert isinstance(step, GraphedTarget) and step.prefill == [] and max(w for w, _ in step.graphs) == WIDTH
    assert len(lines) == 1 and lines[0].startswith(
        "CUDA graphs of target captured for batch sizes [1, 2] x 1 and 4 tokens; prompt graphs off, prompts run eager: "
        "CUDA graph of the 32-token prompt target (batch 1) differs from eager in output 0")
    _assert_calls_match(step, plain, wrapped, [[(0, 0, 9, 0), (1, 0, 5, 0)], [(0, 9, 1, 0), (1, 5, 4, 3)]],
                        config.vocab_size)  # the prompts eager, the window replayed


def test_graphs_are_wanted_on_cuda_for_capturable_formats_only_and_compiled_on_request():
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
    assert compile_graphs({"compile_graphs": "true"}) and not compile_graphs({"compile_graphs": "false"})
    assert not compile_graphs({})  # a repository from before the parameter: uncompiled steps
    with pytest.raises(ValueError, match="parameter 'compile_graphs' must be true or false"):
        compile_graphs({"compile_graphs": "1"})
