"""The continuous-batching engine in-process: the scheduler over TargetWorker / DraftWorker on the
eager tiny DeepSeek-V3 (two MTP layers), with the same hop payloads Triton carries."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.serving.requests import (
    EngineLimits, GenerationRequest, GenerationResponse, QueueFull, RequestError, TokenizerFile, default_limits,
    engine_limits, flag_parameter, parse_request, switch_interval_s,
)
from triton_mtp.serving.scheduler import Scheduler
from triton_mtp.serving.workers import DraftWorker, InProcessHops, TargetWorker, verify_window

MAX_SLOTS = 16
MAX_SEQ_LEN = 64
VOCAB = 128
NUM_MTP_LAYERS = 2


class Collect:
    """A response handle that keeps everything it is sent; `cancel_after` responses, it is cancelled."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.responses: list[tuple[GenerationResponse, bool]] = []
        self.error: str | None = None
        self.cancel_after = cancel_after

    def send(self, response: GenerationResponse, final: bool) -> None:
        self.responses.append((response, final))

    def send_error(self, message: str) -> None:
        self.error = message

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    @property
    def final(self) -> GenerationResponse:
        assert self.error is None, self.error
        assert self.responses and self.responses[-1][1], "no final response"
        return self.responses[-1][0]


@pytest.fixture(scope="module")
def models(drafting_checkpoint: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only spins
    _, target, mtp = load_checkpoint(drafting_checkpoint, max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN, progress=False)
    yield target, mtp
    torch.set_num_threads(threads)


def limits(**overrides) -> EngineLimits:
    values = dict(max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN, vocab_size=VOCAB, max_draft_tokens=6,
                  default_num_draft_tokens=0, eos_token_id=-1, max_queue_size=2000,
                  **default_limits(MAX_SEQ_LEN))
    return EngineLimits(**{**values, **overrides})


def in_process_hops(target, mtp) -> InProcessHops:
    return InProcessHops(TargetWorker(verify_window(target), MAX_SLOTS), DraftWorker(mtp, NUM_MTP_LAYERS, MAX_SLOTS))


def scheduler(models, clock=None, metrics=None, cancel_check_interval_s=0.0, drain_responses=None, stream_interval=1,
              tokenizer=None, spec_disable_rows=0, **overrides) -> Scheduler:
    hops = in_process_hops(*models)
    return Scheduler(hops, limits(**overrides), metrics, tokenizer, **({"clock": clock} if clock else {}),
                     cancel_check_interval_s=cancel_check_interval_s, drain_responses=drain_responses,
                     stream_interval=stream_interval, spec_disable_rows=spec_disable_rows)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=gen).tolist()
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run(engine: Scheduler, requests: list[GenerationRequest]) -> list[Collect]:
    handles = [Collect() for _ in requests]
    for request, handle in zip(requests, handles):
        engine.submit(request, handle)
    engine.run_until_idle()
    return handles


def test_greedy_speculation_emits_exactly_the_plain_greedy_tokens(models):
    batch = prompts(12)
    plain = [h.final.output_ids for h in run(scheduler(models), [GenerationRequest(p, 16) for p in batch])]
    for k in (1, 2, 3, 4):  # 3 and 4 exceed the two MTP layers: layers are reused cyclically
        engine = scheduler(models)
        handles = run(engine, [GenerationRequest(p, 16, num_draft_tokens=k) for p in batch])
        assert [h.final.output_ids for h in handles] == plain, f"k={k}"
        accepted = sum(h.final.total_accepted_draft_tokens for h in handles)
        drafted = sum(h.final.total_draft_tokens for h in handles)
        assert 0 < accepted < drafted, f"k={k}: drafts must be both accepted and rejected to test anything"
        assert engine.metrics.counters["spec_decode_num_accepted_tokens"] == accepted
        assert engine.slots.num_free == MAX_SLOTS


@pytest.mark.parametrize("spec_disable_rows, max_tokens", [(0, (24, 24, 24)), (2, (6, 24, 24))])
def test_draft_distributions_equal_the_mtp_run_over_the_whole_sequence_in_an_empty_slot(models, spec_disable_rows,
                                                                                        max_tokens):
    """After steps that accepted some drafts and rejected others, the distributions of drafts 1-3
    (temperature, top-k) are what the MTP layers give from scratch: layer 0 over every (t_{i+1}, h_i) pair, then layer 1
    and layer 0 again over the pairs extended by the drafts and recycled hidden states. So every
    layer's cache covers every position, and rejected positions were overwritten. With
    `spec_disable_rows` 2, the three requests decode without drafts until the first finishes; the
    first step that drafts again absorbs every pair accepted meanwhile."""
    target, mtp = models
    engine = scheduler(models, spec_disable_rows=spec_disable_rows)
    real_mtp, hops, first_absorbed = engine._hops.mtp, [], {}

    def recording(batch):
        result = real_mtp(batch)
        for b, slot in enumerate(batch.slot_ids.tolist()):  # slot i serves request i here
            first_absorbed.setdefault(slot, int((batch.positions[b] >= 0).sum()))  # pairs of its first mtp hop
            n = int(batch.positions[b].max()) + 2  # sequence length when drafting
            k = int(batch.num_draft[b])
            q = torch.zeros(k, VOCAB).scatter_(1, result.draft_top_ids[b, :k], result.draft_top_probs[b, :k])  # [k, V]
            hops.append((slot, n, result.draft_ids[b, :k].tolist(), q))
        return result

    engine._hops.mtp = recording
    batch = prompts(3, seed=8)
    requests = [GenerationRequest(p, m, temperature=1.5, top_k=3, seed=5, num_draft_tokens=3)
                for p, m in zip(batch, max_tokens)]
    handles = run(engine, requests)
    if spec_disable_rows:  # the first request never drafted; the others' first hop caught up past the prompt
        assert handles[0].final.total_draft_tokens == 0
        assert all(first_absorbed[i] >= len(batch[i]) + 5 for i in (1, 2)), (first_absorbed, batch)
    sequences = [p + h.final.output_ids for p, h in zip(batch, handles)]
    accepted = sum(h.final.total_accepted_draft_tokens for h in handles)
    assert 0 < accepted < sum(h.final.total_draft_tokens for h in handles)
    slot = torch.tensor([MAX_SLOTS - 1])
    checked = 0
    with torch.no_grad():
        for row, n, drafts, draft_probs in hops:
            sequence = sequences[row]
            if len(drafts) < 3:
                continue
            positions = torch.arange(n + 2).view(1, -1)  # [1, n+2]
            _, hidden = target(torch.tensor([sequence[: n - 1]]), positions[:, : n - 1], slot)  # [1, n-1, H]
            ids = torch.tensor([sequence[1:n] + drafts[:2]])  # [1, n+1]
            for step in range(3):
                T = n - 1 + step
                logits, out = mtp(ids[:, :T], hidden, positions[:, :T], slot, step)  # [1, T, V], [1, T, H]
                expected = processed(logits[0, -1], 1.5, 3)  # [V]
                torch.testing.assert_close(draft_probs[step], expected, atol=1e-5, rtol=1e-4)
                hidden = torch.cat([hidden, out[:, -1:]], dim=1)  # [1, T+1, H]
            checked += 1
    assert checked >= (9 if not spec_disable_rows else 4)


def test_steps_with_more_live_rows_than_spec_disable_rows_decode_without_drafts(models):
    batch = prompts(6, seed=3)
    plain = [h.final.output_ids for h in run(scheduler(models), [GenerationRequest(p, 21) for p in batch])]
    engine = scheduler(models, spec_disable_rows=2)
    live_when_drafting, real_mtp = [], engine._hops.mtp
    engine._hops.mtp = lambda batch: (live_when_drafting.append(len(engine._live)), real_mtp(batch))[1]
    handles = run(engine, [GenerationRequest(p, 6 + 3 * i, num_draft_tokens=2) for i, p in enumerate(batch)])
    assert [h.final.output_ids for h in handles] == [out[: 6 + 3 * i] for i, out in enumerate(plain)]
    assert live_when_drafting and max(live_when_drafting) <= 2
    assert handles[-1].final.total_accepted_draft_tokens > 0  # drafting resumed once few rows were left
    assert engine.slots.num_free == MAX_SLOTS
    with pytest.raises(ValueError, match="spec_disable_rows: must be >= 0, got -1"):
        scheduler(models, spec_disable_rows=-1)


def test_pairs_waiting_through_steps_without_drafts_keep_only_their_rows_hidden_states(models):
    """While drafting is off, a target hop's result is let go once the step after it starts: what waits
    is a copy of the rows that will draft again, as wide as their longest wait, not the padded batch."""
    batch = prompts(6, seed=3)
    engine = scheduler(models, spec_disable_rows=2)
    handles = [Collect() for _ in batch]
    for i, (p, handle) in enumerate(zip(batch, handles)):  # two plain rows share every target hop
        engine.submit(GenerationRequest(p, 6 + 3 * i, num_draft_tokens=2 if i % 3 else 0), handle)
    kept = 0
    while not engine.idle:
        waiting = {}  # hop -> its (row, n) that rows which will draft again wait on, as the step starts
        for s in engine._live:
            for hop, row, n in s.absorb_hidden:
                if hop.rows is None and s.num_draft > 0:
                    waiting.setdefault(hop, []).append((row, n))
        engine.step()
        for hop, rows in waiting.items():
            if hop.rows is not None:  # kept in this step
                kept += 1
                assert sorted(hop.rows) == sorted(row for row, _ in rows)
                assert hop.hidden.shape[:2] == (len(rows), max(n for _, n in rows))
    assert kept > 0
    assert all(h.final.output_ids for h in handles)


def test_accepting_drafts_saves_hops(models):
    batch = prompts(4, seed=1)
    plain, spec = scheduler(models), scheduler(models)
    run(plain, [GenerationRequest(p, 24) for p in batch])
    run(spec, [GenerationRequest(p, 24, num_draft_tokens=3) for p in batch])
    assert spec.metrics.hops_per_token < plain.metrics.hops_per_token


def test_accepted_per_position_counts_the_accepted_prefix(models):
    (handle,) = run(scheduler(models), [GenerationRequest(prompts(1, seed=2)[0], 20, num_draft_tokens=3)])
    per_position = handle.final.accepted_per_position
    assert len(per_position) == 3
    assert per_position[0] >= per_position[1] >= per_position[2]
    assert sum(per_position) == handle.final.total_accepted_draft_tokens


def test_sampled_output_repeats_with_its_seed_whatever_shares_the_batch(models):
    request = GenerationRequest(prompts(1, seed=3)[0], 12, temperature=0.8, top_k=30, seed=1234, num_draft_tokens=2)
    (alone,) = run(scheduler(models), [request])
    others = [GenerationRequest(p, 10, temperature=1.0, seed=i, num_draft_tokens=i % 4)
              for i, p in enumerate(prompts(5, seed=4))]
    crowded = run(scheduler(models), others[:2] + [request] + others[2:])
    assert crowded[2].final.output_ids == alone.final.output_ids
    (other_seed,) = run(scheduler(models), [GenerationRequest(**{**request.__dict__, "seed": 99})])
    assert other_seed.final.output_ids != alone.final.output_ids


def test_streaming_sends_each_step_then_a_final_response_with_totals(models):
    prompt = prompts(1, seed=5)[0]
    (whole,) = run(scheduler(models), [GenerationRequest(prompt, 15, num_draft_tokens=2, return_logprobs=True)])
    (streamed,) = run(scheduler(models), [GenerationRequest(prompt, 15, num_draft_tokens=2, return_logprobs=True,
                                                            stream=True)])
    finals = [final for _, final in streamed.responses]
    assert finals == [False] * (len(finals) - 1) + [True]
    assert sum((r.output_ids for r, _ in streamed.responses), []) == whole.final.output_ids
    assert np.allclose(sum((r.logprobs for r, _ in streamed.responses), []), whole.final.logprobs, atol=1e-5)
    assert [r.finish_reason for r, _ in streamed.responses[:-1]] == [""] * (len(finals) - 1)
    assert streamed.final.finish_reason == "length"
    assert streamed.final.num_output_tokens == 15
    assert streamed.final.total_draft_tokens == whole.final.total_draft_tokens


def test_stream_interval_sends_the_first_tokens_at_once_then_every_n_tokens_and_the_same_tokens(models):
    batch = [GenerationRequest(p, 23, num_draft_tokens=k, stream=True) for k, p in enumerate(prompts(3, seed=16))]
    every_step = run(scheduler(models), batch)
    chunked = run(scheduler(models, stream_interval=5), batch)
    for one, five in zip(every_step, chunked):
        sizes = [len(r.output_ids) for r, _ in five.responses]
        tokens = lambda handle: [t for r, _ in handle.responses for t in r.output_ids]  # noqa: E731
        assert tokens(five) == tokens(one)
        assert len(five.responses) < len(one.responses)
        assert sizes[0] == len(one.responses[0][0].output_ids), "the first response waits for no interval"
        assert all(size >= 5 for size in sizes[1:-1]) and sizes[-1] >= 1
        assert five.final.num_output_tokens == 23 and five.final.finish_reason == "length"
    with pytest.raises(ValueError, match="stream_interval"):
        scheduler(models, stream_interval=0)


class RecordingSink:
    """A metric sink that sums what it is sent, and counts the calls (each one a round trip in Triton)."""

    def __init__(self) -> None:
        self.totals: dict[tuple, int] = {}
        self.gauges: dict[str, int] = {}
        self.calls = 0

    def increment(self, name, value, labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.totals[key] = self.totals.get(key, 0) + value
        self.calls += 1

    def set(self, name, value, labels) -> None:
        self.gauges[name] = value
        self.calls += 1


def test_the_metric_sink_gets_coalesced_updates_that_add_up_to_the_counters(models):
    from triton_mtp.serving.metrics import FLUSH_INTERVAL_S, STEP_PHASES, EngineMetrics

    now = [0.0]
    sink = RecordingSink()
    metrics = EngineMetrics(6, sink, clock=lambda: now[0])
    engine = scheduler(models, metrics=metrics)
    batch = [GenerationRequest(p, 12, num_draft_tokens=2, stream=True) for p in prompts(4, seed=11)]
    handles = [Collect() for _ in batch]
    for request, handle in zip(batch, handles):
        engine.submit(request, handle)
    engine.step()  # admits all four: the gauges change, no counter reaches the sink yet
    calls = sink.calls
    engine.step()
    engine.step()
    assert sink.calls == calls, "steady decoding within the flush interval makes no round trip"
    now[0] += FLUSH_INTERVAL_S
    engine.step()
    assert sink.totals[("spec_decode_hops", ())] == metrics.counters["spec_decode_hops"]  # flushed, coalesced
    # one call per changed series: the counters, two draft positions (k = 2), the step phases
    assert sink.calls - calls <= len(metrics.counters) + 2 + len(STEP_PHASES)
    engine.run_until_idle()
    assert all(h.final is not None for h in handles)
    for name, value in metrics.counters.items():
        assert sink.totals[(name, ())] == value, name
    for position, value in enumerate(metrics.accepted_per_position):
        assert sink.totals[("spec_decode_num_accepted_tokens_per_pos", (("position", str(position)),))] == value
    assert sink.totals[("spec_decode_finished_requests", (("reason", "length"),))] == 4
    for phase, seconds in metrics.step_seconds.items():  # every phase of a streaming, drafting step takes time
        assert seconds > 0 and sink.totals[("spec_decode_step_seconds", (("phase", phase),))] == pytest.approx(seconds)
    assert sink.gauges == {"spec_decode_free_slots": MAX_SLOTS, "spec_decode_waiting_requests": 0,
                           "spec_decode_live_sequences": 0}


class GaugeAtFinal(Collect):
    """Records the sink's gauges at the moment the final response is sent."""

    def __init__(self, sink: RecordingSink) -> None:
        super().__init__()
        self.sink, self.gauges_at_final = sink, None

    def send(self, response: GenerationResponse, final: bool) -> None:
        super().send(response, final)
        if final:
            self.gauges_at_final = dict(self.sink.gauges)


def test_a_finished_request_frees_its_slot_in_the_gauges_before_its_final_response(models):
    from triton_mtp.serving.metrics import EngineMetrics

    sink = RecordingSink()
    engine = scheduler(models, metrics=EngineMetrics(6, sink))
    short, long = GaugeAtFinal(sink), GaugeAtFinal(sink)
    engine.submit(GenerationRequest(prompts(1, seed=12)[0], 3, stream=True), short)
    engine.submit(GenerationRequest(prompts(1, seed=13)[0], 9, stream=True), long)
    engine.run_until_idle()
    assert short.gauges_at_final == {"spec_decode_free_slots": MAX_SLOTS - 1, "spec_decode_waiting_requests": 0,
                                     "spec_decode_live_sequences": 1}
    assert long.gauges_at_final == {"spec_decode_free_slots": MAX_SLOTS, "spec_decode_waiting_requests": 0,
                                    "spec_decode_live_sequences": 0}


def test_eos_stops_the_sequence_before_max_tokens(models):
    prompt = prompts(1, seed=6)[0]
    (free_run,) = run(scheduler(models), [GenerationRequest(prompt, 12, num_draft_tokens=2)])
    ids = free_run.final.output_ids
    eos = ids[5]
    (stopped,) = run(scheduler(models, eos_token_id=eos), [GenerationRequest(prompt, 12, num_draft_tokens=2)])
    assert stopped.final.finish_reason == "stop"
    assert stopped.final.output_ids == ids[: ids.index(eos)]


class _TracedHops:
    """In-process hops that log when each target call is launched (chained or not) and when its result is read."""

    overlaps = chains = True

    def __init__(self, hops: InProcessHops) -> None:
        self.hops, self.mtp, self.log, self.decode_steps = hops, hops.mtp, [], hops.decode_steps
        self.on_launch = lambda: None  # called as each call is launched

    def launch_target(self, batch, hidden=True, steps=1):
        return self._traced(self.hops.launch_target(batch, hidden, steps), "launch")

    def launch_chained(self, batch):
        return self._traced(self.hops.launch_chained(batch), "chained")

    def _traced(self, pending, event: str):
        self.on_launch()
        n, log = sum(e != "read" for e, _ in self.log), self.log
        log.append((event, n))

        class Traced:
            next_ids, next_positions = pending.next_ids, pending.next_positions

            def read(self):
                log.append(("read", n))
                return pending.read()

        return Traced()

    def chained(self) -> int:
        return sum(event == "chained" for event, _ in self.log)

    def log_launches(self) -> list[tuple[str, int]]:
        """Each launch in order: ("ahead", n) when an earlier call was still unread, else ("alone", n). A call
        never read (its rows all finished while it ran: the engine leaves it) is in flight for no launch."""
        read = {n for event, n in self.log if event == "read"}
        unread, launches = set(), []
        for event, n in self.log:
            if event == "read":
                unread.discard(n)
            else:
                launches.append(("ahead" if unread else "alone", n))
                unread.update({n} & read)
        return launches

    def launched_ahead(self) -> int:
        """Calls launched while an earlier one was still unread."""
        return sum(event == "ahead" for event, _ in self.log_launches())


@pytest.mark.parametrize("temperature, num_draft_tokens", [(0.0, 0), (0.8, 0), (0.0, 2)])
def test_overlapped_steps_emit_what_one_call_at_a_time_emits(models, temperature, num_draft_tokens):
    """With `overlap`, a step that drafts for no row launches the next step's target call from its emitted
    tokens before reading them. The streamed responses (tokens, logprobs, finish reasons) equal those of one
    call at a time, greedy and seeded sampling, while rows stop on EOS or max_tokens, are cancelled, and
    requests arrive mid-run (they wait for the call in flight); every slot is free at the end. With drafts
    wanted and `spec_disable_rows` 3, steps of more rows overlap, and their pairs wait for the MTP."""
    batch = prompts(7, seed=11)
    (probe,) = run(scheduler(models), [GenerationRequest(batch[0], 12)])
    eos = probe.final.output_ids[4]  # request 0 stops on EOS after 4 tokens, greedy

    def serve(overlap: bool):
        hops = _TracedHops(in_process_hops(*models))
        engine = Scheduler(hops, limits(eos_token_id=eos), overlap=overlap, spec_disable_rows=3 if num_draft_tokens else 0)
        handles = [Collect(cancel_after=3 if n == 2 and not num_draft_tokens else None) for n in range(len(batch))]
        requests = [GenerationRequest(p, 12 + 3 * n, stream=True, temperature=temperature, seed=n, return_logprobs=True,
                                      num_draft_tokens=num_draft_tokens) for n, p in enumerate(batch)]
        for request, handle in zip(requests[:4], handles):
            engine.submit(request, handle)
        for _ in range(3):
            engine.step()
        for request, handle in zip(requests[4:], handles[4:]):  # while a call may be in flight
            engine.submit(request, handle)
        engine.run_until_idle()
        assert engine.slots.num_free == MAX_SLOTS
        return [[(r.output_ids, r.logprobs, r.finish_reason) for r, _ in h.responses] for h in handles], hops

    (expected, one_at_a_time), (got, overlapped) = serve(False), serve(True)
    if num_draft_tokens:  # a step after rows finish may draft one call at a time, not overlapped: other chunks
        got, expected = ([[(sum((ids for ids, _, _ in r), []), sum((lp for _, lp, _ in r), []), r[-1][2])] for r in rs]
                         for rs in (got, expected))
    for got_responses, expected_responses in zip(got, expected):  # late arrivals join a batch a step later:
        assert [(ids, reason) for ids, _, reason in got_responses] == \
            [(ids, reason) for ids, _, reason in expected_responses]  # float sums may differ in the last bits
        for (_, got_logprobs, _), (_, expected_logprobs, _) in zip(got_responses, expected_responses):
            assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-5)
    assert one_at_a_time.launched_ahead() == 0 and overlapped.launched_ahead() > 10
    reasons = {responses[-1][2] for responses in got}
    assert "length" in reasons and (temperature > 0 or "stop" in reasons) and (num_draft_tokens or "cancelled" in reasons)


def test_cancelled_request_is_dropped_and_its_slot_freed(models):
    engine = scheduler(models)
    cancelled, kept = Collect(cancel_after=2), Collect()
    prompt = prompts(1, seed=7)[0]
    engine.submit(GenerationRequest(prompt, 40, stream=True), cancelled)
    engine.submit(GenerationRequest(prompt, 10), kept)
    engine.run_until_idle()
    assert cancelled.final.finish_reason == "cancelled"
    assert cancelled.final.num_output_tokens < 40
    assert kept.final.finish_reason == "length"
    assert engine.slots.num_free == MAX_SLOTS


class CountingAsks(Collect):
    """Counts how often the engine asks whether the request was cancelled."""

    asks = 0

    def is_cancelled(self) -> bool:
        self.asks += 1
        return super().is_cancelled()


def test_cancellation_is_checked_at_most_once_per_interval_and_still_caught(models):
    now = [0.0]
    engine = scheduler(models, clock=lambda: now[0], cancel_check_interval_s=0.05)
    handle = CountingAsks(cancel_after=2)
    engine.submit(GenerationRequest(prompts(1, seed=8)[0], 40, stream=True), handle)
    for _ in range(5):  # the clock stands still: the first step's check found no live request, then none
        engine.step()
    assert handle.asks == 1 and len(handle.responses) == 5 and not handle.responses[-1][1]  # asked on admission
    now[0] += 0.05
    engine.step()
    assert handle.final.finish_reason == "cancelled" and engine.slots.num_free == MAX_SLOTS


class SlowHandle(Collect):
    """Records which thread sent each response, taking `delay_s` per send (a round trip to the server)."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        super().__init__()
        self.delay_s, self.fail, self.threads, self.sent = delay_s, fail, set(), 0

    def send(self, response: GenerationResponse, final: bool) -> None:
        time.sleep(self.delay_s)
        self.sent += 1  # attempted, failed or not
        self.threads.add(threading.current_thread().name)
        if self.fail and not final:
            raise ConnectionError("client gone")
        super().send(response, final)


@pytest.mark.parametrize("lag_steps", [0, 1])
def test_response_threads_keep_each_requests_order_and_drain_before_the_next_step(models, lag_steps):
    """A drain waits for what was handed over before the drain `lag_steps` earlier: with 0, for everything."""
    from triton_mtp.serving.responses import ResponseThreads

    batch = [GenerationRequest(p, 10, num_draft_tokens=2, stream=True) for p in prompts(6, seed=12)]
    inline = run(scheduler(models), batch)
    responses = ResponseThreads(3, lag_steps=lag_steps)
    handles = [SlowHandle(delay_s=0.02, fail=(i == 5)) for i in range(len(batch))]
    handed, drains = [0], []  # drains: (handed over before the drain, sent once it returned)

    class Counted:  # what the engine hands over, as it hands it over
        def __init__(self, handle) -> None:
            self.handle = handle

        def send(self, response, final) -> None:
            handed[0] += 1
            self.handle.send(response, final)

        def is_cancelled(self) -> bool:
            return self.handle.is_cancelled()

    def drain() -> None:  # as spec_decode's model wires it, checking what is left unsent after it
        before = handed[0]
        responses.drain()
        drains.append((before, sum(h.sent for h in handles)))

    engine = scheduler(models, drain_responses=drain)
    for request, handle in zip(batch, handles):
        engine.submit(request, Counted(responses.handle(handle)))
    engine.run_until_idle()
    responses.close()  # sends what is still queued
    assert len(drains) > 5
    waited_for = [0] * lag_steps + [before for before, _ in drains]  # what each drain waits for
    assert all(sent >= waited for (_, sent), waited in zip(drains, waited_for)), "a drain returned too early"
    behind = [before - sent for before, sent in drains]
    if lag_steps:
        assert max(behind) > 0, "the responses of the step before are not waited for"
    else:
        assert set(behind) == {0}, "each step waits for the previous step's responses"
    for got, expected in zip(handles[:5], inline):
        assert [r for r, _ in got.responses] == [r for r, _ in expected.responses]  # same responses, in order
        assert [final for _, final in got.responses] == [final for _, final in expected.responses]
    assert handles[5].final.output_ids == inline[5].final.output_ids  # a failing send fails nothing else
    assert len({name for h in handles for name in h.threads}) == 3 and all(len(h.threads) == 1 for h in handles)
    with pytest.raises(ValueError, match="response_threads"):
        ResponseThreads(0)
    with pytest.raises(ValueError, match="response_lag_steps"):
        ResponseThreads(1, lag_steps=-1)


class AskedFrom(Collect):
    """Records which threads asked whether the request was cancelled."""

    def __init__(self, cancel_after: int | None = None) -> None:
        super().__init__(cancel_after)
        self.askers: set[str] = set()

    def is_cancelled(self) -> bool:
        self.askers.add(threading.current_thread().name)
        return super().is_cancelled()


def test_response_threads_ask_whether_requests_were_cancelled_so_the_engine_thread_does_not(models):
    """Asking is a round trip to the server in Triton: with response threads, each asks for its own requests
    every interval and the engine reads the answer it last got. A cancelled request is still dropped early and
    its slot freed, and only the response threads ever ask."""
    from triton_mtp.serving.responses import ResponseThreads

    responses = ResponseThreads(2, cancel_check_interval_s=0.005)
    cancelled, kept = AskedFrom(cancel_after=2), AskedFrom()
    engine = scheduler(models)  # asks (the handles) every step
    prompt = prompts(1, seed=7)[0]
    engine.submit(GenerationRequest(prompt, 60, stream=True), responses.handle(cancelled))
    engine.submit(GenerationRequest(prompt, 10), responses.handle(kept))
    while not engine.idle:
        engine.step()
        time.sleep(0.002)  # a step's worth of device time, during which the threads send and ask
    responses.close()
    assert cancelled.final.finish_reason == "cancelled" and cancelled.final.num_output_tokens < 60
    assert kept.final.finish_reason == "length"
    assert engine.slots.num_free == MAX_SLOTS
    askers = cancelled.askers | kept.askers
    assert cancelled.askers and all(name.startswith("spec_decode-responses-") for name in askers)


def test_requests_beyond_the_queue_bound_are_refused(models):
    engine = scheduler(models, max_queue_size=2)
    for _ in range(MAX_SLOTS + 2):
        engine.submit(GenerationRequest([5, 6], 3), Collect())
    with pytest.raises(QueueFull, match="slots are busy"):
        engine.submit(GenerationRequest([5, 6], 3), Collect())
    engine.run_until_idle()
    engine.submit(GenerationRequest([5, 6], 3), Collect())


def test_a_failing_hop_fails_its_requests_and_the_loop_goes_on(models):
    engine = scheduler(models)
    real_target = engine._hops.launch_target
    calls = []

    def flaky_target(batch, *args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("target: out of memory")
        return real_target(batch, *args)

    engine._hops.launch_target = flaky_target
    (failed,) = run(engine, [GenerationRequest([5, 6, 7], 8)])
    assert failed.error == "spec_decode: RuntimeError: target: out of memory"
    assert engine.slots.num_free == MAX_SLOTS
    (ok,) = run(engine, [GenerationRequest([5, 6, 7], 8)])
    assert ok.final.num_output_tokens == 8


def test_requests_past_request_timeout_fail_waiting_or_live_and_free_their_slots(models):
    now = [100.0]
    engine = scheduler(models, clock=lambda: now[0], request_timeout_s=10.0)
    handles = [Collect() for _ in range(MAX_SLOTS + 2)]  # two of them wait for a slot
    for handle in handles:
        engine.submit(GenerationRequest([5, 6], 40, stream=True), handle)
    engine.step()
    now[0] = 110.0  # exactly at the deadline: still served
    engine.step()
    assert all(h.error is None for h in handles)
    assert len(handles[0].responses) == 2
    now[0] = 110.001
    engine.step()
    assert all(h.error == "request_timeout_s: the request did not finish within 10 s" for h in handles)
    assert engine.idle and engine.slots.num_free == MAX_SLOTS
    assert engine.metrics.finished["timeout"] == MAX_SLOTS + 2
    (later,) = run(engine, [GenerationRequest([5, 6], 3)])
    assert later.final.num_output_tokens == 3


class Gone(Collect):
    """A client that disconnected: sending it anything fails."""

    def send_error(self, message: str) -> None:
        raise RuntimeError("the stream is closed")


def test_an_expired_request_whose_client_is_gone_leaves_the_others_running(models):
    now = [0.0]
    engine = scheduler(models, clock=lambda: now[0], request_timeout_s=5.0)
    gone, other = Gone(), Collect()
    engine.submit(GenerationRequest([5, 6], 40), gone)
    now[0] = 1.0
    engine.submit(GenerationRequest([5, 6, 7], 6), other)
    now[0] = 5.5  # past the first request's deadline only
    engine.run_until_idle()
    assert other.error is None and other.final.num_output_tokens == 6
    assert engine.metrics.finished["timeout"] == 1 and engine.slots.num_free == MAX_SLOTS


class Words:
    """A tokenizer with one token per whitespace-separated word (ids from their length)."""

    def encode(self, text: str) -> list[int]:
        return [2 + len(word) % (VOCAB - 2) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * (i - 2) for i in ids)


BUNDLED_TOKENIZER = Path(__file__).parent.parent / "models" / "tiny-dsv3-mtp" / "tokenizer.json"


class CountingDecodes(TokenizerFile):
    """The bundled byte-level BPE tokenizer, counting whole-output decodes (ids below VOCAB are single
    bytes, some of them halves of UTF-8 characters)."""

    decodes = 0

    def decode(self, ids: list[int]) -> str:
        self.decodes += 1
        return super().decode(ids)


def test_streamed_text_is_detokenized_incrementally_and_adds_up_to_the_decoded_output(models):
    tokenizer = CountingDecodes(BUNDLED_TOKENIZER)
    engine = scheduler(models, tokenizer=tokenizer)
    batch = [GenerationRequest(p, 40, temperature=1.0, seed=seed, num_draft_tokens=seed % 3, stream=True)
             for seed, p in enumerate(prompts(6, seed=14))]
    handles = run(engine, batch)
    assert tokenizer.decodes == len(batch), "one whole-output decode per request, for its final response"
    texts = [tokenizer.decode([t for r, _ in h.responses for t in r.output_ids]) for h in handles]
    assert any("\ufffd" in t for t in texts), "no incomplete UTF-8 character: the hold-back is not exercised"
    for handle, text in zip(handles, texts):
        assert "".join(r.text_output for r, _ in handle.responses) == text
        assert all("\ufffd" not in r.text_output[-1:] for r, final in handle.responses if not final)


def test_a_stop_word_ends_the_output_at_the_first_token_whose_text_contains_it(models):
    tokenizer = TokenizerFile(BUNDLED_TOKENIZER)
    engine = scheduler(models, tokenizer=tokenizer)
    prompt = prompts(1, seed=15)[0]
    (free,) = run(engine, [GenerationRequest(prompt, 40)])
    ids = free.final.output_ids
    text = tokenizer.decode(ids)
    word = next(text[i: i + 3] for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i: i + 3])
    n = next(n for n in range(1, len(ids) + 1) if word in tokenizer.decode(ids[:n]))
    for stream in (False, True):
        (stopped,) = run(engine, [GenerationRequest(prompt, 40, stop_words=["\x00never", word], stream=stream)])
        assert stopped.final.finish_reason == "stop"
        assert "".join(r.text_output for r, _ in stopped.responses) == tokenizer.decode(ids[:n]).split(word)[0]
        assert [t for r, _ in stopped.responses for t in r.output_ids] == ids[:n]


def test_request_limits_admit_their_edge_and_refuse_one_more():
    edge = limits(max_prompt_bytes=11, max_prompt_tokens=3, max_output_tokens=6)
    text = {"text_input": np.array([b"ab cd efghi"], dtype=np.object_), "max_tokens": np.array([6], dtype=np.int32)}
    assert parse_request(text, edge, Words()).max_tokens == 6
    cases = [
        ({**text, "text_input": np.array([b"ab cd efghij"], dtype=np.object_)},
         "text_input: 12 bytes exceeds max_prompt_bytes 11"),
        ({**text, "text_input": np.array([b"a b c d"], dtype=np.object_)},
         "text_input: 4 prompt tokens exceed max_prompt_tokens 3"),
        ({"input_ids": np.array([5, 6, 7, 8], dtype=np.int32), "max_tokens": np.array([6], dtype=np.int32)},
         "input_ids: 4 prompt tokens exceed max_prompt_tokens 3"),
        ({**text, "max_tokens": np.array([7], dtype=np.int32)}, "max_tokens: 7 exceeds max_output_tokens 6"),
    ]
    for fields, message in cases:
        with pytest.raises(RequestError) as error:
            parse_request(fields, edge, Words())
        assert str(error.value) == message


def test_request_limits_default_from_max_seq_len_and_are_checked_at_load_time():
    params = {"max_slots": "4", "max_seq_len": "64", "vocab_size": "128", "max_draft_tokens": "4",
              "num_mtp_layers": "2", "default_num_draft_tokens": "2", "eos_token_id": "1", "max_queue_size": "8"}
    loaded = engine_limits(params)
    assert (loaded.max_prompt_bytes, loaded.max_prompt_tokens, loaded.max_output_tokens) == (1024, 63, 63)
    assert loaded.request_timeout_s == 600.0
    assert engine_limits({**params, "request_timeout_s": "0"}).request_timeout_s == 0.0
    for key, value in (("request_timeout_s", "-1"), ("request_timeout_s", "inf"), ("max_prompt_bytes", "0")):
        with pytest.raises(ValueError, match=f"parameter '{key}' must be"):
            engine_limits({**params, key: value})


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities (bins expecting < 5 merged)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor(float(keep.sum() - 1))
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.mark.parametrize("num_draft_tokens, top_k, steps", [(0, 6, 3), (2, 6, 3), (2, 0, 2)])
def test_sampled_tokens_follow_the_target_distribution(models, num_draft_tokens, top_k, steps):
    """The first tokens over many seeds against their exact marginals under the processed target.

    With k = 2, token 1 comes from prefill, later ones from accepted, recovered or bonus tokens.
    Without top-k the MTP distribution is wider than the DRAFT_SUPPORT its drafts are drawn from.
    """
    prompt, samples, temperature = [7, 19, 3], 1500, 1.3
    marginals = exact_marginals(models[0], prompt, steps, temperature, top_k)  # [steps, V]
    engine = scheduler(models)
    handles = run(engine, [GenerationRequest(prompt, steps + 1, temperature=temperature, top_k=top_k, seed=seed,
                                             num_draft_tokens=num_draft_tokens) for seed in range(samples)])
    outputs = torch.tensor([h.final.output_ids for h in handles])  # [N, steps+1]
    for i in range(steps):
        counts = torch.bincount(outputs[:, i], minlength=VOCAB).float()  # [V]
        assert chi_square_p_value(counts, marginals[i]) > 1e-3, f"token {i + 1}"
    if num_draft_tokens:
        assert engine.metrics.counters["spec_decode_num_accepted_tokens"] > samples // 2


def exact_marginals(target, prompt: list[int], steps: int, temperature: float, top_k: int,
                    eos: int | None = None) -> torch.Tensor:
    """[steps, V]: P(token i = v), summing over every continuation inside the top-k supports.

    With `eos`, a sequence ends at it, and its later tokens count as `eos` too.
    """
    slot = torch.tensor([MAX_SLOTS - 1])
    prefixes, marginals = {(): 1.0}, torch.zeros(steps, VOCAB)
    with torch.no_grad():
        for i in range(steps):
            longer = {}
            for prefix, mass in prefixes.items():
                if prefix and prefix[-1] == eos:
                    marginals[i, eos] += mass
                    longer[prefix] = mass
                    continue
                ids = torch.tensor([prompt + list(prefix)])  # [1, T]
                logits, _ = target(ids, torch.arange(ids.shape[1]).view(1, -1), slot)  # [1, T, V]
                p = processed(logits[0, -1], temperature, top_k)  # [V]
                marginals[i] += mass * p
                longer.update({prefix + (t,): mass * float(p[t]) for t in p.nonzero().squeeze(1).tolist()})
            prefixes = longer
    return marginals


def processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The target distribution at one position after temperature and top-k (0: off)."""
    scaled = logits / temperature  # [V]
    if not top_k:
        return scaled.softmax(-1)  # [V]
    kth = scaled.topk(top_k).values[-1]
    return scaled.masked_fill(scaled < kth, float("-inf")).softmax(-1)  # [V]


BAD_INPUTS = [
    ({"max_tokens": [4]}, "text_input"),
    ({"input_ids": [5], "text_input": [b"hi"], "max_tokens": [4]}, "text_input"),
    ({"input_ids": [], "max_tokens": [4]}, "input_ids"),
    ({"input_ids": [5] * 60, "max_tokens": [5]}, "max_tokens"),
    ({"input_ids": [5], "max_tokens": [0]}, "max_tokens"),
    ({"input_ids": [5], "max_tokens": [4], "temperature": [-0.5]}, "temperature"),
    ({"input_ids": [5], "max_tokens": [4], "temperature": [float("nan")]}, "temperature"),
    ({"input_ids": [5], "max_tokens": [4], "top_p": [0.0]}, "top_p"),
    ({"input_ids": [5], "max_tokens": [4], "top_p": [1.5]}, "top_p"),
    ({"input_ids": [5], "max_tokens": [4], "top_k": [-1]}, "top_k"),
    ({"input_ids": [5], "max_tokens": [4], "num_draft_tokens": [-1]}, "num_draft_tokens"),
    ({"input_ids": [5], "max_tokens": [4], "num_draft_tokens": [7]}, "num_draft_tokens"),
    ({"input_ids": [5, VOCAB], "max_tokens": [4]}, "input_ids"),
    ({"input_ids": [5], "max_tokens": [4, 4]}, "max_tokens"),
    ({"input_ids": [5], "max_tokens": [4.0]}, "max_tokens"),
]


def _arrays(fields: dict) -> dict[str, np.ndarray]:
    dtypes = {"input_ids": np.int32, "max_tokens": None, "temperature": np.float32, "top_p": np.float32,
              "top_k": np.int32, "num_draft_tokens": np.int32, "text_input": np.object_}
    return {k: np.array(v, dtype=dtypes.get(k)) if dtypes.get(k) else np.array(v) for k, v in fields.items()}


@pytest.mark.parametrize("fields, field", BAD_INPUTS)
def test_bad_request_names_the_field(fields, field):
    with pytest.raises(RequestError) as error:
        parse_request(_arrays(fields), limits(), tokenizer=None)
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ")


def test_a_flag_parameter_is_true_or_false_and_defaults_where_a_repository_predates_it():
    assert flag_parameter({"overlap": "false"}, "overlap", default=True) is False
    assert flag_parameter({}, "overlap", default=True) is True and flag_parameter({}, "cuda_graphs") is False
    with pytest.raises(ValueError, match="parameter 'overlap' must be true or false, got 'yes'"):
        flag_parameter({"overlap": "yes"}, "overlap", default=True)


def test_the_switch_interval_parameter_is_microseconds_and_zero_or_absent_keeps_pythons():
    assert switch_interval_s({"switch_interval_us": "250"}) == pytest.approx(250e-6)
    assert switch_interval_s({"switch_interval_us": "0"}) is None and switch_interval_s({}) is None
    with pytest.raises(ValueError, match="switch_interval_us"):
        switch_interval_s({"switch_interval_us": "-1"})


def test_unfilled_config_parameter_is_named_at_load_time():
    params = {"max_slots": "4", "max_seq_len": "64", "vocab_size": "128", "max_draft_tokens": "4",
              "num_mtp_layers": "2", "default_num_draft_tokens": "2", "eos_token_id": "1",
              "max_queue_size": "${max_queue_size}"}
    with pytest.raises(ValueError, match="parameter 'max_queue_size' must be an integer"):
        engine_limits(params)
    assert engine_limits({**params, "max_queue_size": "8"}).max_queue_size == 8


def test_a_payload_moves_with_one_packed_copy_and_keeps_every_value():
    from triton_mtp.serving.transfers import packed_copy
    from triton_mtp.serving.workers import TargetResult

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-5, 5, (3, 5), generator=gen), torch.rand(3, generator=gen) > 0.5,
               torch.randn(3, 2, 7, generator=gen), torch.zeros(0, dtype=torch.int64),
               torch.randn(4, 3, generator=gen).t(), torch.arange(12).view(3, 4)[:, 1]]
    # unaligned sizes, an empty tensor, a transposed one and a strided 1-D slice
    moved = packed_copy(tensors, torch.device("cpu"))
    for before, after in zip(tensors, moved):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # views of one buffer
    result = TargetResult(tensors[0], tensors[0][:, 0], tensors[2][:, 0].float(), tensors[2])
    arrays = result.to_arrays()
    assert set(arrays) == {"output_ids", "num_accepted", "logprobs", "hidden"}
    assert np.array_equal(arrays["hidden"], tensors[2].numpy())


class _Stream:
    """A CUDA stream's device and handle, and its host wait, counted."""

    def __init__(self, device: int, handle: int) -> None:
        self.device_index, self.cuda_stream, self.synchronized = device, handle, 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_pinned_buffer_is_reused_without_a_wait_once_a_later_event_on_its_stream_was_waited_on():
    from triton_mtp.serving.transfers import StreamOrder

    order, stream, other = StreamOrder(), _Stream(0, 0), _Stream(1, 0)  # two devices' default streams
    copy = order.ticket()  # a copy through a pinned buffer
    event = order.ticket()  # an event recorded after it, which the host then waits on
    assert not order.has_run(stream, copy)
    order.ran(stream, event)
    assert order.has_run(stream, copy) and order.has_run(stream, event)
    order.wait(stream, copy)
    assert stream.synchronized == 0  # known to have run: no wait
    late = order.ticket()  # a copy after the event: not known to have run
    assert not order.has_run(stream, late) and not order.has_run(other, copy)  # nor anything on another stream
    order.ran(stream, copy)  # an older event waited on later does not move the stream back
    assert order.has_run(stream, event) and not order.has_run(stream, late)
    order.wait(other, copy)  # unknown: the host waits for the stream's work so far, and then knows all of it ran
    assert other.synchronized == 1 and order.has_run(other, late)
    order.wait(other, late)
    assert other.synchronized == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_payload_round_trips_through_the_gpu():
    from triton_mtp.serving.workers import TargetBatch

    batch = TargetBatch(temperature=torch.tensor([0.0, 0.7]), top_k=torch.tensor([0, 5]), top_p=torch.tensor([1.0, 0.9]),
                        seeds=torch.tensor([1, -2]), new=torch.tensor([True, False]),
                        token_ids=torch.arange(10).view(2, 5), positions=torch.arange(10).view(2, 5) - 1,
                        slot_ids=torch.tensor([3, 0]), num_draft=torch.zeros(0, dtype=torch.int64))
    on_gpu = batch.to("cuda")
    assert on_gpu.token_ids.device.type == "cuda" and on_gpu.draft_top_ids is None
    assert on_gpu.to("cuda:0").token_ids is on_gpu.token_ids  # already there: not copied again
    back = on_gpu.to("cpu")
    for name in ("temperature", "top_k", "top_p", "seeds", "new", "token_ids", "positions", "slot_ids", "num_draft"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pending_target_result_reads_its_own_call_while_later_ones_reuse_the_pinned_buffers():
    """Results copied to the host asynchronously are each call's own, although the pinned buffers they pass
    through are reused, and the next call's input tokens never leave the device."""
    from triton_mtp.serving.workers import PendingTarget, TargetResult

    device = torch.device("cuda")
    pendings, expected = [], []
    for n in range(10):  # more calls than the ring has buffers, the earlier results read last
        ids = torch.full((3, 2), n, device=device)
        hidden = torch.full((3, 2, 8), float(n), device=device)
        pendings.append(PendingTarget(TargetResult(ids, ids[:, 0], ids.float(), hidden), hidden=n % 2 == 0))
        expected.append(n)
        if len(pendings) == 2:  # as the engine: the next call is launched before the previous is read
            pending, n_read = pendings.pop(0), expected.pop(0)
            assert pending.next_ids.device.type == "cuda"
            result = pending.read()
            assert result.output_ids == [[n_read] * 2] * 3 and result.num_accepted == [n_read] * 3
            assert (result.hidden is None) == (n_read % 2 == 1)
            if result.hidden is not None:
                assert torch.equal(result.hidden, torch.full((3, 2, 8), float(n_read)))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_chained_steps_draft_on_the_device_what_the_mtp_hop_drafts(models, k):
    """Greedy rows with drafts verify and draft their next window in one chained launch, the next launched
    before the host reads the one before. Their output equals plain decoding, and each row's drafts equal
    those the mtp hop drafts one call at a time (the same accepted count at every position): the pairs the
    device absorbs and the windows it builds are the host's. Rows end on EOS and max_tokens, late requests
    join, and every slot is free at the end."""
    batch = prompts(6, seed=21)
    plain = [h.final.output_ids for h in run(scheduler(models), [GenerationRequest(p, 16 + 3 * n)
                                                                 for n, p in enumerate(batch)])]
    eos = plain[1][9]

    def serve(overlap: bool):
        hops = _TracedHops(in_process_hops(*models))
        engine = Scheduler(hops, limits(eos_token_id=eos), overlap=overlap)
        handles = [Collect() for _ in batch]
        requests = [GenerationRequest(p, 16 + 3 * n, num_draft_tokens=k) for n, p in enumerate(batch)]
        for request, handle in zip(requests[:4], handles):
            engine.submit(request, handle)
        for _ in range(4):
            engine.step()
        for request, handle in zip(requests[4:], handles[4:]):
            engine.submit(request, handle)
        engine.run_until_idle()
        assert engine.slots.num_free == MAX_SLOTS
        counters = engine.metrics.counters
        assert (counters["spec_decode_chained_calls"], counters["spec_decode_calls_ahead"]) == \
            (hops.chained(), hops.launched_ahead())
        return [h.final for h in handles], hops

    (expected, one_at_a_time), (got, chained) = serve(False), serve(True)
    cut = [ids[: ids.index(eos)] if eos in ids else ids for ids in plain]
    assert [r.output_ids for r in got] == [r.output_ids for r in expected] == cut
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert {r.finish_reason for r in got} == {"stop", "length"}
    assert [r.accepted_per_position for r in got] == [r.accepted_per_position for r in expected]
    assert [r.total_draft_tokens for r in got] == [r.total_draft_tokens for r in expected]
    assert 0 < sum(r.total_accepted_draft_tokens for r in got) < sum(r.total_draft_tokens for r in got)
    assert one_at_a_time.chained() == 0 and chained.chained() > 5 and chained.launched_ahead() > 3


@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_calls_go_ahead_while_requests_wait_for_a_busy_slot(models, num_draft_tokens):
    """With every slot busy, a waiting request cannot be admitted whether or not the next call goes ahead, so
    calls go ahead while it waits (plain and chained); it is admitted once a slot is free, and the output
    equals one call at a time."""
    batch = prompts(5, seed=31)

    def serve(overlap: bool):
        hops = _TracedHops(in_process_hops(*models))
        engine = Scheduler(hops, limits(max_slots=2), overlap=overlap)
        waiting_at_launch = []
        hops.on_launch = lambda: waiting_at_launch.append(len(engine._waiting))
        handles = run(engine, [GenerationRequest(p, 14 + 2 * n, num_draft_tokens=num_draft_tokens)
                               for n, p in enumerate(batch)])
        assert engine.slots.num_free == 2
        ahead_while_waiting = sum(1 for (event, _), waiting in zip(hops.log_launches(), waiting_at_launch)
                                  if event == "ahead" and waiting)
        return [h.final.output_ids for h in handles], ahead_while_waiting

    (expected, _), (got, ahead_while_waiting) = serve(False), serve(True)
    assert got == expected
    assert ahead_while_waiting >= 5


@pytest.mark.parametrize("temperature, num_draft_tokens", [(0.0, 0), (0.8, 0), (0.0, 2)])
def test_requests_are_admitted_while_calls_go_ahead(models, temperature, num_draft_tokens):
    """Requests that arrive while calls go ahead are admitted on the way: their prompts go in a call launched
    before the previous result is read, and the next call takes their first tokens on the device. Slots freed by
    rows that stopped on EOS are given again meanwhile, a call never carries a finished row beside the new one in
    its slot, a request of one token finishes with its prompt, and the output equals one call at a time (greedy
    and seeded sampling; with drafts wanted, `spec_disable_rows` 1 keeps drafting off)."""
    batch = prompts(8, seed=53)
    (probe,) = run(scheduler(models), [GenerationRequest(batch[0], 12)])
    eos = probe.final.output_ids[3]  # request 0 stops on EOS after 3 tokens, greedy

    def serve(overlap: bool):
        hops = _TracedHops(in_process_hops(*models))
        calls = []  # per target call: (slots, rows prefilled, launched while a call was unread)
        launch = hops.launch_target

        def traced(batch, *args):
            unread = {n for e, n in hops.log if e != "read"} - {n for e, n in hops.log if e == "read"}
            calls.append((batch.slot_ids.tolist(), int(batch.new.sum()), bool(unread)))
            return launch(batch, *args)

        hops.launch_target = traced
        engine = Scheduler(hops, limits(max_slots=4, eos_token_id=eos), overlap=overlap,
                           spec_disable_rows=1 if num_draft_tokens else 0)
        handles = [Collect() for _ in batch]
        requests = [GenerationRequest(p, 1 if n == 5 else 9 + 2 * n, stream=True, temperature=temperature, seed=n,
                                      return_logprobs=True, num_draft_tokens=num_draft_tokens)
                    for n, p in enumerate(batch)]
        for n, (request, handle) in enumerate(zip(requests, handles)):  # one arrives every other step
            engine.submit(request, handle)
            for _ in range(2 if n >= 2 else 0):
                engine.step()
        engine.run_until_idle()
        assert engine.slots.num_free == 4
        outputs = [(sum((r.output_ids for r, _ in h.responses), []), sum((r.logprobs for r, _ in h.responses), []),
                    h.responses[-1][0].finish_reason) for h in handles]
        return outputs, calls

    (expected, _), (got, calls) = serve(False), serve(True)
    assert [(ids, reason) for ids, _, reason in got] == [(ids, reason) for ids, _, reason in expected]
    for (_, got_logprobs, _), (_, expected_logprobs, _) in zip(got, expected):
        assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-5)
    assert (temperature > 0 or got[0][2] == "stop") and len(got[5][0]) == 1
    assert all(len(set(slots)) == len(slots) for slots, _, _ in calls)  # no slot twice in one call
    assert sum(1 for _, new, ahead in calls if new and ahead) >= 4  # prompts launched ahead
    assert sum(1 for _, new, ahead in calls if ahead) > len(calls) * 3 // 4


@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_requests_admitted_while_rows_decode_are_prefilled_in_a_call_of_their_own(models, num_draft_tokens):
    """With `separate_prefill`, a step that admits requests while others decode prefills them in a call of
    their own: no call mixes a prompt with decoding windows, so the decoding rows' calls stay k + 1 tokens
    wide at most (a decode graph's), greedy speculative rows keep chaining through the admissions, and the
    output equals that of mixed calls."""
    batch = prompts(6, seed=41)

    def serve(separate: bool):
        hops = _TracedHops(in_process_hops(*models))
        calls = []  # per target call: (rows prefilled, rows decoding, tokens wide)
        for name in ("launch_target", "launch_chained"):
            def traced(batch, *args, launch=getattr(hops, name)):
                new = int(batch.new.sum())
                calls.append((new, len(batch.new) - new, batch.token_ids.shape[1]))
                return launch(batch, *args)
            setattr(hops, name, traced)
        engine = Scheduler(hops, limits(), separate_prefill=separate)
        handles = [Collect() for _ in batch]
        requests = [GenerationRequest(p, 10 + 2 * n, num_draft_tokens=num_draft_tokens) for n, p in enumerate(batch)]
        for request, handle in zip(requests, handles):  # one arrives every other step while the others decode
            engine.submit(request, handle)
            engine.step()
            engine.step()
        engine.run_until_idle()
        assert engine.slots.num_free == MAX_SLOTS
        return [h.final.output_ids for h in handles], calls, hops.chained()

    (expected, mixed_calls, mixed_chained), (got, calls, chained) = serve(False), serve(True)
    assert got == expected
    assert any(new and decoding for new, decoding, _ in mixed_calls)  # the case at stake happens
    assert not any(new and decoding for new, decoding, _ in calls)
    assert max(width for new, _, width in calls if not new) <= num_draft_tokens + 1
    assert sum(1 for new, _, _ in calls if new) > 1  # several prompts went in calls of their own
    if num_draft_tokens:
        assert chained > mixed_chained


def test_requests_arriving_while_a_response_thread_asks_about_others_leave_it_sending():
    """`handle()` (the server's `execute`) adds requests while a response thread asks about the ones it has: the
    thread asks from a copy, so it keeps running and sends what comes after."""
    from triton_mtp.serving.responses import ResponseThreads

    responses = ResponseThreads(1, cancel_check_interval_s=0.005)
    arrived = []

    class ArrivingWhileAsked(Collect):
        def is_cancelled(self) -> bool:
            if not arrived:  # a request arrives in the middle of the thread's asking
                arrived.append(responses.handle(Collect()))
            return False

    responses.handle(ArrivingWhileAsked())
    deadline = time.monotonic() + 10
    while not arrived:
        assert time.monotonic() < deadline, "the thread never asked"
        time.sleep(0.005)
    later = Collect()
    responses.handle(later).send(GenerationResponse("", [1], None, "length", 1, 1, 0, 0, []), True)
    while not later.responses:  # sent only if the thread still runs
        assert time.monotonic() < deadline, "the response thread stopped sending"
        time.sleep(0.005)
    responses.close()
    assert later.final.output_ids == [1]


def test_a_request_refused_while_response_threads_send_is_not_asked_about_again(models):
    """A request the engine refuses (QueueFull) is answered by its caller; its sending thread must not keep
    asking the server whether it was cancelled (a round trip every interval, for good)."""
    from triton_mtp.serving.responses import ResponseThreads

    responses = ResponseThreads(1, cancel_check_interval_s=0.005)
    engine = scheduler(models, max_slots=1, max_queue_size=0)
    kept, refused = AskedFrom(), AskedFrom()
    prompt = prompts(1, seed=9)[0]
    responses.submit(engine.submit, GenerationRequest(prompt, 8), kept)
    with pytest.raises(QueueFull):
        responses.submit(engine.submit, GenerationRequest(prompt, 8), refused)
    time.sleep(0.05)  # ten intervals
    engine.run_until_idle()
    responses.close()
    assert kept.final.finish_reason == "length" and kept.askers and not refused.askers
    with pytest.raises(ValueError, match="cancel_check_interval_s"):
        ResponseThreads(1, cancel_check_interval_s=0)


def test_chained_windows_stay_inside_the_kv_cache_when_requests_fill_it(models):
    """Requests whose prompt and max_tokens fill the KV cache chain their steps until the next window would not
    fit: no call writes a position past max_seq_len, and the tokens are plain greedy decoding's."""
    target, mtp = models
    written = []

    def logged_target(token_ids, positions, slot_ids):
        written.append(int(positions.max()))
        return target(token_ids, positions, slot_ids)

    def logged_mtp(token_ids, hidden, positions, slot_ids, layer=0):
        written.append(int(positions.max()))
        return mtp(token_ids, hidden, positions, slot_ids, layer)

    batch = prompts(3, seed=51)
    requests = [GenerationRequest(p, MAX_SEQ_LEN - len(p), num_draft_tokens=3) for p in batch]
    plain = [h.final.output_ids for h in run(scheduler(models), [GenerationRequest(p, r.max_tokens)
                                                                 for p, r in zip(batch, requests)])]
    hops = _TracedHops(in_process_hops(logged_target, logged_mtp))
    got = run(Scheduler(hops, limits()), requests)
    assert [h.final.output_ids for h in got] == plain
    assert [h.final.finish_reason for h in got] == ["length"] * len(batch)
    assert hops.chained() > 10 and max(written) == MAX_SEQ_LEN - 1  # up to the last position, and not past it


def test_drafting_stays_off_in_a_step_that_prefills_apart_when_the_live_rows_exceed_spec_disable_rows(models):
    """`spec_disable_rows` counts every live row, including those whose prompts go in a call of their own: a
    step that admits a request beyond the limit does not chain the others."""
    hops = _TracedHops(in_process_hops(*models))
    engine = Scheduler(hops, limits(), spec_disable_rows=1)
    live_at_chained = []
    launch = hops.launch_chained

    def traced(batch):
        live_at_chained.append(len(engine._live))
        return launch(batch)

    hops.launch_chained = traced
    first, second = prompts(2, seed=61)
    engine.submit(GenerationRequest(first, 30, num_draft_tokens=2), Collect())
    for _ in range(4):
        engine.step()
    engine.submit(GenerationRequest(second, 10, num_draft_tokens=2), Collect())
    engine.run_until_idle()
    assert live_at_chained and set(live_at_chained) == {1}
