"""Speculative-decoding counters of the engine, mirrored to Prometheus through a sink.

Vocabulary (vLLM's): a *draft* is one proposal of up to k tokens for one sequence; *accepted*
tokens are drafts the target kept; mean acceptance length = 1 + accepted / drafts (it counts
the bonus or recovered token). A *hop* is one call from `spec_decode` into the target or MTP worker: a
BLS call into the `target` or `mtp` model, or, with local hops, a call in its own process.

Each update of a Triton custom metric is a round trip from the Python backend's stub to the server
(a message and its reply, as in a BLS call), so the sink sees coalesced counter increments: at most every
FLUSH_INTERVAL_S, whenever a request finishes (before its final response is sent, so a client that
reads the metrics after it sees them) and when the engine goes idle. Gauges are set when they change.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol

COUNTERS = {
    "spec_decode_num_drafts": "Draft proposals (one per sequence per step with k > 0)",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the target",
    "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted, by draft position",
    "spec_decode_hops": "Calls from spec_decode into the target and mtp workers (BLS calls, or in process with local hops)",
    "spec_decode_calls_ahead": "Target calls launched before the previous step's result was read (overlapped steps, "
                               "local hops)",
    "spec_decode_chained_calls": "Target calls that also drafted the next window on the device (chained speculative "
                                 "steps, local hops)",
    "spec_decode_emitted_tokens": "Tokens emitted to requests",
    "spec_decode_finished_requests": "Requests finished, by finish_reason (length, stop, cancelled), error or timeout",
    "spec_decode_steps": "Engine steps (one pass over every live sequence)",
    "spec_decode_step_seconds": "Wall time of engine steps by phase: mtp and target (the two hops), respond (sending "
                                "responses), engine (the rest: scheduling, batching, emitting)",
}
STEP_PHASES = ("mtp", "target", "respond", "engine")
FINISH_REASONS = ("length", "stop", "cancelled", "error", "timeout")
GAUGES = {
    "spec_decode_live_sequences": "Sequences holding a slot",
    "spec_decode_free_slots": "Free KV-cache slots",
    "spec_decode_waiting_requests": "Requests waiting for a slot",
}


class MetricSink(Protocol):
    def increment(self, name: str, value: float, labels: dict[str, str]) -> None: ...
    def set(self, name: str, value: int, labels: dict[str, str]) -> None: ...


FLUSH_INTERVAL_S = 0.25


class EngineMetrics:
    """Running totals; `hops_per_token` is the number the engine design tries to push down."""

    def __init__(self, max_draft_tokens: int, sink: MetricSink | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        labelled = ("spec_decode_num_accepted_tokens_per_pos", "spec_decode_finished_requests", "spec_decode_step_seconds")
        self.counters = {name: 0 for name in COUNTERS if name not in labelled}
        self.accepted_per_position = [0] * max_draft_tokens
        self._position_keys = [("spec_decode_num_accepted_tokens_per_pos", (("position", str(position)),))
                               for position in range(max_draft_tokens)]  # their `_pending` keys, built once
        self.finished = {reason: 0 for reason in FINISH_REASONS}
        self.gauges = {name: 0 for name in GAUGES}
        self.step_seconds = {phase: 0.0 for phase in STEP_PHASES}
        self._sink = sink
        self._clock = clock
        self._pending: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # increments not yet in the sink
        self._flushed_at = clock()
        if sink is not None:  # every series exists from the start, at 0
            for name in self.counters:
                sink.increment(name, 0, {})
            for position in range(max_draft_tokens):
                sink.increment("spec_decode_num_accepted_tokens_per_pos", 0, {"position": str(position)})
            for reason in FINISH_REASONS:
                sink.increment("spec_decode_finished_requests", 0, {"reason": reason})
            for phase in STEP_PHASES:
                sink.increment("spec_decode_step_seconds", 0, {"phase": phase})
            for name in GAUGES:
                sink.set(name, 0, {})

    def _add(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        if labels is None:
            self.counters[name] += value
        if self._sink is not None and value:
            self._pend((name, tuple(sorted(labels.items())) if labels else ()), value)

    def _pend(self, key: tuple[str, tuple[tuple[str, str], ...]], value: float) -> None:
        self._pending[key] = self._pending.get(key, 0) + value

    def flush(self) -> None:
        """Hand the coalesced increments to the sink."""
        pending, self._pending = self._pending, {}
        self._flushed_at = self._clock()
        for (name, labels), value in pending.items():
            self._sink.increment(name, value, dict(labels))

    def flush_if_due(self) -> None:
        if self._pending and self._clock() - self._flushed_at >= FLUSH_INTERVAL_S:
            self.flush()

    def hop(self) -> None:
        self._add("spec_decode_hops", 1)

    def launched(self, chained: bool, ahead: bool) -> None:
        """A target call: `chained` drafts the next window too, `ahead` goes before the previous result is read."""
        self._add("spec_decode_chained_calls", int(chained))
        self._add("spec_decode_calls_ahead", int(ahead))

    def emitted(self, num_tokens: int) -> None:
        self._add("spec_decode_emitted_tokens", num_tokens)

    def draft(self, num_draft: int, num_accepted: int) -> None:
        """One sequence's proposal of `num_draft` tokens, of which the first `num_accepted` were kept."""
        self._add("spec_decode_num_drafts", 1)
        self._add("spec_decode_num_draft_tokens", num_draft)
        self._add("spec_decode_num_accepted_tokens", num_accepted)
        for position in range(num_accepted):  # once per accepted token: the labelled key is not built each time
            self.accepted_per_position[position] += 1
            if self._sink is not None:
                self._pend(self._position_keys[position], 1)

    def step(self, seconds: dict[str, float]) -> None:
        """One engine step took `seconds` per phase (STEP_PHASES)."""
        self._add("spec_decode_steps", 1)
        for phase, value in seconds.items():
            self.step_seconds[phase] += value
            self._add("spec_decode_step_seconds", value, {"phase": phase})

    def finish(self, reason: str) -> None:
        """A request ends: counted, and everything pending flushed before its final response goes out."""
        self.finished[reason] += 1
        self._add("spec_decode_finished_requests", 1, {"reason": reason})
        if self._sink is not None:
            self.flush()

    def occupancy(self, live: int, free_slots: int, waiting: int) -> None:
        """Set the gauges that changed (live last: when it reads 0, the free slots are already counted)."""
        for name, value in (("spec_decode_free_slots", free_slots), ("spec_decode_waiting_requests", waiting),
                            ("spec_decode_live_sequences", live)):
            if self.gauges[name] != value:
                self.gauges[name] = value
                if self._sink is not None:
                    self._sink.set(name, value, {})

    @property
    def hops_per_token(self) -> float:
        emitted = self.counters["spec_decode_emitted_tokens"]
        return self.counters["spec_decode_hops"] / emitted if emitted else 0.0
