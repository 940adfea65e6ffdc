"""Speculative-decoding counters of the engine, mirrored to Prometheus through a sink.

Vocabulary (vLLM's): a *draft* is one proposal of up to k tokens for one sequence; *accepted*
tokens are drafts the target kept; mean acceptance length = 1 + accepted / drafts (it counts
the bonus or recovered token). A *hop* is one call from `spec_decode` into the target or MTP worker: a
BLS call into the `target` or `mtp` model, or, with local hops, a call in its own process.
"""
from __future__ import annotations

from typing import Protocol

COUNTERS = {
    "spec_decode_num_drafts": "Draft proposals (one per sequence per step with k > 0)",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted by the target",
    "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted, by draft position",
    "spec_decode_hops": "Calls from spec_decode into the target and mtp workers (BLS calls, or in process with local hops)",
    "spec_decode_emitted_tokens": "Tokens emitted to requests",
    "spec_decode_finished_requests": "Requests finished, by finish_reason (length, stop, cancelled), error or timeout",
}
FINISH_REASONS = ("length", "stop", "cancelled", "error", "timeout")
GAUGES = {
    "spec_decode_live_sequences": "Sequences holding a slot",
    "spec_decode_free_slots": "Free KV-cache slots",
    "spec_decode_waiting_requests": "Requests waiting for a slot",
}


class MetricSink(Protocol):
    def increment(self, name: str, value: int, labels: dict[str, str]) -> None: ...
    def set(self, name: str, value: int, labels: dict[str, str]) -> None: ...


class EngineMetrics:
    """Running totals; `hops_per_token` is the number the engine design tries to push down."""

    def __init__(self, max_draft_tokens: int, sink: MetricSink | None = None) -> None:
        labelled = ("spec_decode_num_accepted_tokens_per_pos", "spec_decode_finished_requests")
        self.counters = {name: 0 for name in COUNTERS if name not in labelled}
        self.accepted_per_position = [0] * max_draft_tokens
        self.finished = {reason: 0 for reason in FINISH_REASONS}
        self.gauges = {name: 0 for name in GAUGES}
        self._sink = sink
        if sink is not None:  # every series exists from the start, at 0
            for name in self.counters:
                sink.increment(name, 0, {})
            for position in range(max_draft_tokens):
                sink.increment("spec_decode_num_accepted_tokens_per_pos", 0, {"position": str(position)})
            for reason in FINISH_REASONS:
                sink.increment("spec_decode_finished_requests", 0, {"reason": reason})

    def _add(self, name: str, value: int, labels: dict[str, str] | None = None) -> None:
        if labels is None:
            self.counters[name] += value
        if self._sink is not None and value:
            self._sink.increment(name, value, labels or {})

    def hop(self) -> None:
        self._add("spec_decode_hops", 1)

    def emitted(self, num_tokens: int) -> None:
        self._add("spec_decode_emitted_tokens", num_tokens)

    def draft(self, num_draft: int, num_accepted: int) -> None:
        """One sequence's proposal of `num_draft` tokens, of which the first `num_accepted` were kept."""
        self._add("spec_decode_num_drafts", 1)
        self._add("spec_decode_num_draft_tokens", num_draft)
        self._add("spec_decode_num_accepted_tokens", num_accepted)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
            self._add("spec_decode_num_accepted_tokens_per_pos", 1, {"position": str(position)})

    def finish(self, reason: str) -> None:
        self.finished[reason] += 1
        self._add("spec_decode_finished_requests", 1, {"reason": reason})

    def occupancy(self, live: int, free_slots: int, waiting: int) -> None:
        for name, value in (("spec_decode_live_sequences", live), ("spec_decode_free_slots", free_slots),
                            ("spec_decode_waiting_requests", waiting)):
            self.gauges[name] = value
            if self._sink is not None:
                self._sink.set(name, value, {})

    @property
    def hops_per_token(self) -> float:
        emitted = self.counters["spec_decode_emitted_tokens"]
        return self.counters["spec_decode_hops"] / emitted if emitted else 0.0
