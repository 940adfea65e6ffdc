"""Continuous batching for `spec_decode`: one loop, one `mtp` hop and one `target` hop per step.

Every step serves all live sequences together:

1. admit waiting requests into free slots (their prompt joins this step's target hop);
2. `mtp` hop for the sequences that speculate: absorb the tokens accepted in the previous step
   (paired with the target's hidden states; after prefill, the shifted prompt) and draft
   k = min(num_draft_tokens, tokens still allowed - 1) tokens each;
3. `target` hop for every sequence: prefill rows carry their prompt, decoding rows the window
   [last token, drafts]; sampling and acceptance happen inside the target;
4. emit the accepted tokens plus the recovered/bonus token, check max_tokens / EOS / stop words,
   stream, and free the slots of finished sequences.

Rejected drafts are never undone: the next step's window starts at the sequence's real length and
writes over their cache positions. Plain decoding (k = 0) rows skip the mtp hop entirely. With
`spec_disable_rows`, a step with more live sequences skips drafting (vLLM's
`speculative_disable_by_batch_size`): the pairs its rows accept wait, and the next step that drafts
absorbs them all in its mtp hop, so the MTP layers' caches catch up.

Where the hops return before the device is done (`overlaps`: the workers in this process) and no row
drafts in this step or the next (plain rows, or drafting off under `spec_disable_rows`), a step launches
the next step's target call from its own emitted tokens, still on the device, before it reads its
results: the device runs one call while the host emits and streams the other (SGLang's overlap
scheduler, vLLM's async scheduling). Rows that finish meanwhile leave that call's result unread.
Where the hops also `chain`, a step whose rows all decode greedily with drafts verifies them and drafts
the next window on the device in one launch (the pairs it accepts go to the MTP from where they are):
the next step needs no mtp hop, and its call can go ahead in the same way before this one is read.
Where the hops run `decode_steps` N > 1, a call over rows that all decode greedily without drafts runs N
target steps (vLLM's multi-step scheduling): each row emits N tokens, cut at EOS or max_tokens as any window.
The loop is pb_utils-free: hops and response senders come in through small protocols.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from triton_mtp.serving.metrics import EngineMetrics
from triton_mtp.serving.requests import (
    EngineLimits, GenerationRequest, GenerationResponse, QueueFull, TextStream, Tokenizer,
)
from triton_mtp.serving.sampling import GREEDY_TEMPERATURE
from triton_mtp.serving.slots import SlotPool
from triton_mtp.serving.transfers import packed_copy
from triton_mtp.serving.workers import DraftBatch, DraftResult, HostResult, PendingTarget, TargetBatch


class Hops(Protocol):
    """The two calls a step makes; each is one process hop when served by Triton. `overlaps`: whether
    `launch_target` returns before the device has run the call, so that another can be launched first.
    `hidden`: whether the result carries the hidden states (some row pends MTP pairs). `chains`: whether
    `launch_chained` is offered (a greedy verify that drafts the next window on the device). `decode_steps`:
    how many target steps a call over greedy one-token rows may run (`launch_target`'s `steps`, 1 or it)."""

    overlaps: bool
    chains: bool
    decode_steps: int

    def launch_target(self, batch: TargetBatch, hidden: bool = True, steps: int = 1) -> PendingTarget: ...
    def launch_chained(self, batch: TargetBatch) -> PendingTarget: ...
    def mtp(self, batch: DraftBatch) -> DraftResult: ...


class ResponseHandle(Protocol):
    """Where one request's responses go (a Triton response sender, or a list in tests)."""

    def send(self, response: GenerationResponse, final: bool) -> None: ...
    def send_error(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


class FinalResponse:
    """A `ResponseHandle` that keeps a request's final response (or its error), for callers that run the engine
    in process and read the whole output at the end."""

    def __init__(self) -> None:
        self.final: GenerationResponse | None = None
        self.error: str | None = None

    def send(self, response: GenerationResponse, final: bool) -> None:
        if final:
            self.final = response

    def send_error(self, message: str) -> None:
        self.error = message

    def is_cancelled(self) -> bool:
        return False


@dataclass(eq=False)  # a request waiting for a slot is itself: compared by identity
class _Waiting:
    request: GenerationRequest
    handle: ResponseHandle
    deadline: float  # clock time after which it fails; inf = no limit


class _StepHidden:
    """One target hop's hidden states [B, T, H], which its rows pend slices of (`rows` maps a hop row to
    its row in `hidden`). The whole result is only needed until the next mtp hop absorbs the pairs; a
    step that leaves pairs waiting past its own target hop calls `own()` first, which keeps a copy of
    the waiting slices alone, in one gather, and lets the result go. The result may also be a buffer
    that the next hop overwrites (the decode graphs' outputs where the hops do not copy them)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden, self.rows = hidden, None

    def row(self, row: int) -> torch.Tensor:
        """[T, H]: the hop's hidden states of `row` (KeyError once owned without it)."""
        return self.hidden[row if self.rows is None else self.rows[row]]

    def own(self, rows: list[int], width: int) -> None:
        """Keep hidden[rows, :width] only (hop rows in ascending order)."""
        if self.rows is None:
            index = torch.tensor(rows, device=self.hidden.device)  # [R]
            self.hidden, self.rows = self.hidden[:, :width].index_select(0, index), {r: i for i, r in enumerate(rows)}


@dataclass(eq=False)  # a sequence is itself: compared (and hashed) by identity
class _Sequence:
    request: GenerationRequest
    handle: ResponseHandle
    slot: int
    deadline: float
    tokens: list[int]  # prompt + emitted; tokens[-1] is the next step's input
    prefilled: bool = False
    drafting: bool = False  # the mtp has seen this sequence (its generator is seeded)
    absorb_tokens: list[int] = field(default_factory=list)  # t_{i+1} for the next mtp hop
    absorb_hidden: list[tuple[_StepHidden, int, int]] = field(default_factory=list)  # (hop, row, n): h_i paired with them
    absorb_start: int = 0  # position i of the first pair
    drafts: list[int] = field(default_factory=list)
    draft_top_ids: torch.Tensor | None = None  # [k, N] support of q (sampled drafts only)
    draft_top_probs: torch.Tensor | None = None  # [k, N] q on it
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_sent: int = 0  # output tokens already sent in a response
    text_stream: TextStream | None = None  # detokenizes streams and stop-word requests token by token
    text: str = ""  # the output's text so far, whole characters only (with a text stream)
    text_sent: str = ""
    stop_text: str | None = None  # output text cut before the stop word that ended it
    finish_reason: str = ""
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def pend(self, tokens: list[int], hidden: tuple[_StepHidden, int, int], start: int) -> None:
        """Queue MTP pairs (t_{i+1}, h_i), i = start.., after those the mtp has not absorbed yet; `hidden` is
        (hop, row, n): h_i are the hop's hidden[row, :n]."""
        if not self.absorb_tokens:
            self.absorb_start = start
        self.absorb_tokens.extend(tokens)  # the row's own list: the mtp hop replaces it once absorbed
        self.absorb_hidden.append(hidden)

    def absorbed_hidden(self) -> torch.Tensor:
        """[n, H]: the hidden states of the pairs queued so far."""
        return torch.cat([hop.row(row)[:n] for hop, row, n in self.absorb_hidden])

    @property
    def num_draft(self) -> int:
        """Drafts for the next step: never more than the tokens still allowed after the bonus one."""
        left = self.request.max_tokens - len(self.output_ids) - 1
        return max(0, min(self.request.num_draft_tokens, left))


@dataclass
class _Launched:
    """A target call in flight: its rows and the position of each row's first token in it (where the host
    knows it). A `chained` call also drafts the rows' next window; their pairs never reach the host."""

    pending: PendingTarget
    rows: list[_Sequence]
    starts: list[int]
    params: dict[str, torch.Tensor] | None  # its rows' `_row_params` when none was new: the next call reuses them
    chained: bool = False
    prompts: _Launched | None = None  # launched just before it: the prompts of its new rows, read first
    steps: int = 1  # target steps it runs: each row emits this many tokens (multi-step decoding), or its window's

    @property
    def every_row(self) -> list[_Sequence]:
        """Its rows and its prompts' (a request of one token is in its prompt's call alone)."""
        return self.rows + (self.prompts.rows if self.prompts else [])


def _on_device(index: list[int], device: torch.device) -> torch.Tensor:
    """`index` as an int64 tensor on `device`, built with numpy and copied without waiting for the device."""
    (moved,) = packed_copy([torch.from_numpy(np.array(index, dtype=np.int64))], device)
    return moved


def _padded(values, length: int, pad: int) -> list[int]:
    values = list(values)
    return values + [pad] * (length - len(values))


def _row_params(rows: list[_Sequence], new: list[bool]) -> dict[str, torch.Tensor]:
    requests = [s.request for s in rows]
    return {
        "temperature": torch.tensor([r.temperature for r in requests], dtype=torch.float32),  # [B]
        "top_k": torch.tensor([r.top_k for r in requests], dtype=torch.int64),  # [B]
        "top_p": torch.tensor([r.top_p for r in requests], dtype=torch.float32),  # [B]
        "seeds": torch.tensor([r.seed - (1 << 64) if r.seed >= 1 << 63 else r.seed for r in requests],
                              dtype=torch.int64),  # [B]
        "new": torch.tensor(new, dtype=torch.bool),  # [B]
        "slot_ids": torch.tensor([s.slot for s in rows], dtype=torch.int64),  # [B]
    }


def _drafts_after(request: GenerationRequest, emitted: int) -> bool:
    """Whether a row with `emitted` output tokens drafts in the call after the one in flight, which emits one more:
    it may draft min(num_draft_tokens, max_tokens - (emitted + 1) - 1) tokens (`_Sequence.num_draft`)."""
    return request.num_draft_tokens > 0 and request.max_tokens - emitted > 2


def _next_params(call: _Launched, rows: list[_Sequence]) -> dict[str, torch.Tensor]:
    """`_row_params` of a call launched after `call` over `rows` (none new): `call`'s own when its rows are the
    same and none was new in it, as from one decode step to the next, which saves building them per step."""
    if call.params is not None and rows == call.rows:  # the same rows in order (compared by identity)
        return call.params
    return _row_params(rows, [False] * len(rows))


class Scheduler:
    """Owns the slots, the waiting queue and the step loop (run by `start()` or step by step)."""

    def __init__(self, hops: Hops, limits: EngineLimits, metrics: EngineMetrics | None = None,
                 tokenizer: Tokenizer | None = None, clock: Callable[[], float] = time.monotonic,
                 cancel_check_interval_s: float = 0.0, drain_responses: Callable[[], None] | None = None,
                 stream_interval: int = 1, spec_disable_rows: int = 0, overlap: bool = True,
                 separate_prefill: bool = True) -> None:
        """`cancel_check_interval_s`: how often live requests are asked whether they were cancelled (0:
        every step); in Triton each question is a round trip to the server. `drain_responses`: when the
        handles queue their sends (serving/responses.py), waits for the previous step's to go out; it is
        called after a step's hops, before the step hands over its own. `stream_interval`: a streamed
        request gets a response once this many of its tokens are unsent (1: every step); its first
        tokens go at once and the rest with the final response. Like SGLang's and vLLM's
        `--stream-interval`, it trades inter-token smoothness for fewer responses, each a round trip.
        `spec_disable_rows` > 0: steps with more live sequences than this decode without drafts (0: never).
        Where a batched step is bound by launches and per-row work rather than by weights, verifying
        drafts costs more than they save (docs/benchmarks.md, runs 12-13). `overlap`: launch the next
        step's target call before reading this one's when no row drafts in either, or when every row's
        drafts come from the call before it (a chained verify, where the hops chain), where the hops allow
        it (off: one call at a time, drafts from the mtp hop). `separate_prefill` (where calls overlap): a step
        that admits requests prefills them in a call of their own before the decoding rows' call, which stays
        a decode graph's call (and chained) instead of a call as wide as the longest prompt; the new rows join
        the others' calls from the next step."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {stream_interval}")
        if spec_disable_rows < 0:
            raise ValueError(f"spec_disable_rows: must be >= 0, got {spec_disable_rows}")
        self._hops = hops
        self._limits = limits
        self._tokenizer = tokenizer
        self._clock = clock
        self._cancel_check_interval_s = cancel_check_interval_s
        self._drain_responses = drain_responses
        self._stream_interval = stream_interval
        self._spec_disable_rows = spec_disable_rows
        self._overlap = overlap and hops.overlaps
        self._chain = self._overlap and hops.chains
        self._separate_prefill = separate_prefill and self._overlap
        self._decode_steps = hops.decode_steps
        self._ahead: _Launched | None = None  # the next step's target call, launched by this one
        self._cancel_checked_at = -float("inf")
        self.metrics = metrics or EngineMetrics(limits.max_draft_tokens)
        self.slots = SlotPool(limits.max_slots)
        self._waiting: deque[_Waiting] = deque()
        self._live: list[_Sequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._phases = {"mtp": 0.0, "target": 0.0, "respond": 0.0}
        self._last_hidden: _StepHidden | None = None  # the latest target hop's, which rows may still pend
        self._publish()

    # ---- requests in -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, handle: ResponseHandle) -> None:
        """Queue a validated request; raises QueueFull when it would wait beyond the bound."""
        with self._cond:
            if len(self._waiting) >= self._limits.max_queue_size + self.slots.num_free:
                raise QueueFull(
                    f"spec_decode: all {self._limits.max_slots} slots are busy and "
                    f"{self._limits.max_queue_size} requests are waiting; retry later"
                )
            timeout = self._limits.request_timeout_s
            deadline = self._clock() + timeout if timeout > 0 else float("inf")
            self._waiting.append(_Waiting(request, handle, deadline))
            self._cond.notify()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and not self._live

    # ---- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spec_decode-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; requests still queued or live get an error response."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        for s in list(self._live):
            self._fail(s, "spec_decode: the model is being unloaded")
        while self._waiting:
            self._waiting.popleft().handle.send_error("spec_decode: the model is being unloaded")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._live:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one step
                for s in list(self._live):
                    self._fail(s, f"spec_decode: {type(exc).__name__}: {exc}")

    def run_until_idle(self) -> None:
        """Step until no request is live or waiting (for in-process use)."""
        while not self.idle:
            self.step()

    def step(self) -> None:
        """One engine step over all live sequences."""
        start = time.perf_counter()
        self._phases = {"mtp": 0.0, "target": 0.0, "respond": 0.0}  # seconds of this step, added by _timed
        self._drop_cancelled()
        self._drop_expired()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not any(s in self._live for s in ahead.every_row):
            ahead = None  # its rows all finished: its work on the device is left unread
        if ahead is None:  # else requests wait one step: this step's call is already running
            self._admit()
        live = list(self._live)
        if ahead is not None:  # the previous step launched this one's call: live <= its rows and prompts', none drafts
            self._keep_waiting_pairs(live, [])
            self._guarded(live, lambda rows: self._complete(ahead))
        elif live:
            drafting = [s for s in live if s.prefilled and s.num_draft > 0 and not s.drafts]  # else chained
            if self._spec_disable_rows and len(live) > self._spec_disable_rows:
                drafting = []  # their accepted pairs wait for the next step that drafts
            self._keep_waiting_pairs(live, drafting)
            if drafting:
                self._guarded(drafting, self._propose)
            rows = [s for s in live if s in self._live]
            decoding = [s for s in rows if s.prefilled] if self._separate_prefill else rows
            if 0 < len(decoding) < len(rows):
                self._guarded([s for s in rows if not s.prefilled], self._verify)  # the prompts in a call of their own
                rows = [s for s in decoding if s in self._live]
            self._guarded(rows, self._verify)
        if live:
            self.metrics.step({**self._phases, "engine": time.perf_counter() - start - sum(self._phases.values())})
        self._publish()

    def _keep_waiting_pairs(self, live: list[_Sequence], drafting: list[_Sequence]) -> None:
        """Before this step's target hop: when a row that will draft again does not draft now, keep the
        previous hop's hidden states its pairs (and the drafting rows' pairs) need. Older hops are
        already kept, or fully absorbed by now."""
        hop, self._last_hidden = self._last_hidden, None
        if hop is None:
            return
        drafts = set(drafting)
        if not any(s.absorb_tokens and s.num_draft > 0 and s not in drafts for s in live):
            return
        # a row pends once per call, so only its newest entry can be this hop's: a scan of whole lists would grow
        # with every step that drafting stays off
        needed = {row: n for s in live if s.num_draft > 0 and s.absorb_hidden
                  for h, row, n in s.absorb_hidden[-1:] if h is hop}
        if needed:
            hop.own(sorted(needed), max(needed.values()))

    def _timed(self, phase: str, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self._phases[phase] += time.perf_counter() - start

    def _guarded(self, rows: list[_Sequence], hop) -> None:
        """Run a hop; if it fails, the sequences in it get the error and the loop goes on."""
        try:
            hop(rows)
        except Exception as exc:  # noqa: BLE001 - reported to the requests of this hop
            for s in rows:
                if s in self._live:
                    self._fail(s, f"spec_decode: {type(exc).__name__}: {exc}")

    def _drop_cancelled(self) -> None:
        now = self._clock()
        if now - self._cancel_checked_at < self._cancel_check_interval_s:
            return
        self._cancel_checked_at = now
        for s in list(self._live):
            if s.handle.is_cancelled():
                s.finish_reason = "cancelled"
                self._finish(s)

    def _drop_expired(self) -> None:
        """Fail every request, waiting or live, past its `request_timeout_s` (its slot is freed)."""
        now = self._clock()
        with self._cond:
            expired = [w for w in self._waiting if w.deadline < now]
            for w in expired:
                self._waiting.remove(w)
        timed_out = [s for s in self._live if s.deadline < now]
        if not expired and not timed_out:
            return
        message = f"request_timeout_s: the request did not finish within {self._limits.request_timeout_s:g} s"
        for w in expired:
            self.metrics.finish("timeout")
            try:
                w.handle.send_error(message)
            except Exception:  # noqa: BLE001 - the client is gone; nothing is left to tell it
                pass
        for s in timed_out:
            self._fail(s, message, reason="timeout")

    def _admit(self, limit: int | None = None) -> list[_Sequence]:
        """Give waiting requests free slots (at most `limit` taken from the queue); returns the new sequences."""
        admitted, taken = [], 0
        while limit is None or taken < limit:
            with self._cond:
                if not self._waiting or self.slots.num_free == 0:
                    break
                waiting = self._waiting.popleft()
            taken += 1
            request, handle = waiting.request, waiting.handle
            if handle.is_cancelled():
                self.metrics.finish("cancelled")
                handle.send(self._cancelled_response(request), final=True)
                continue
            slot = self.slots.allocate()
            text_stream = (self._tokenizer.decode_stream()
                           if self._tokenizer is not None and (request.stream or request.stop_words) else None)
            admitted.append(_Sequence(request, handle, slot, waiting.deadline, list(request.input_ids),
                                      text_stream=text_stream, accepted_per_position=[0] * request.num_draft_tokens))
            self._live.append(admitted[-1])
        return admitted

    # ---- the two hops --------------------------------------------------------------------------
    def _propose(self, rows: list[_Sequence]) -> None:
        B = len(rows)
        T = max(len(s.absorb_tokens) for s in rows)
        H = rows[0].absorb_hidden[0][0].hidden.shape[-1]  # [.., T, H] whether owned or not
        token_ids = torch.tensor([_padded(s.absorb_tokens, T, 0) for s in rows], dtype=torch.int64)  # [B, T]
        positions = torch.tensor([_padded(range(s.absorb_start, s.absorb_start + len(s.absorb_tokens)), T, -1)
                                  for s in rows], dtype=torch.int64)  # [B, T]
        hidden = torch.zeros(B, T, H, dtype=torch.float32)  # [B, T, H]
        for b, s in enumerate(rows):
            hidden[b, : len(s.absorb_tokens)] = s.absorbed_hidden()
        wanted = [s.num_draft for s in rows]
        num_draft = torch.tensor(wanted, dtype=torch.int64)  # [B]
        batch = DraftBatch(**_row_params(rows, [not s.drafting for s in rows]),
                           token_ids=token_ids, hidden=hidden, positions=positions, num_draft=num_draft)
        result = self._timed("mtp", self._hops.mtp, batch)
        self.metrics.hop()
        draft_ids = result.draft_ids.tolist()  # [B][K]
        for b, (s, k) in enumerate(zip(rows, wanted)):
            s.drafting = True
            s.absorb_tokens, s.absorb_hidden = [], []  # absorbed
            s.drafts = draft_ids[b][:k]
            if result.draft_top_ids is not None:
                s.draft_top_ids, s.draft_top_probs = result.draft_top_ids[b, :k], result.draft_top_probs[b, :k]

    def _verify(self, rows: list[_Sequence]) -> None:
        batch, starts, params = self._target_batch(rows)
        if self._chains(rows, [len(s.drafts) + 1 for s in rows]):
            self._complete(self._launch_chained(rows, batch, params, starts, ahead=False))
            return
        one_token = self._decode_steps > 1 and all(s.prefilled and not s.drafts for s in rows)  # (no prompt, no window)
        self._complete(self._launch_target(rows, batch, starts, params, ahead=False,
                                           steps=self._steps(rows, starts) if one_token else 1))

    def _steps(self, rows: list[_Sequence], starts: list[int]) -> int:
        """Target steps of a call over `rows`, one token each at positions `starts`, none drafting: `decode_steps`
        where every row decodes greedily and the positions it writes fit its KV cache (max_seq_len), else 1. A row
        may need fewer tokens: those past max_tokens or EOS are cut (`_emit`)."""
        n = self._decode_steps
        if n > 1 and all(s.request.temperature < GREEDY_TEMPERATURE and start + n <= self._limits.max_seq_len
                         for s, start in zip(rows, starts)):
            return n
        return 1

    def _launch_target(self, rows: list[_Sequence], batch: TargetBatch, starts: list[int],
                       params: dict[str, torch.Tensor] | None, ahead: bool,
                       prompts: _Launched | None = None, steps: int = 1) -> _Launched:
        hidden = any(s.request.num_draft_tokens for s in rows)  # rows that pend MTP pairs need the hidden states
        pending = self._timed("target", self._hops.launch_target, batch, hidden, steps)
        self.metrics.hop()
        self.metrics.launched(chained=False, ahead=ahead)
        return _Launched(pending, rows, starts, params, prompts=prompts, steps=steps)

    def _target_batch(self, rows: list[_Sequence]) -> tuple[TargetBatch, list[int], dict[str, torch.Tensor] | None]:
        """A target call's batch over `rows` (prompts whole, decoding rows their window), where each row's first
        token goes, and the row parameters for the next call over them (None where some row is new)."""
        windows, starts = [], []
        for s in rows:
            if s.prefilled:
                windows.append([s.tokens[-1]] + s.drafts)
                starts.append(len(s.tokens) - 1)
            else:
                windows.append(s.tokens)
                starts.append(0)
        B, T = len(rows), max(len(w) for w in windows)
        token_ids = torch.tensor([_padded(w, T, 0) for w in windows], dtype=torch.int64)  # [B, T]
        positions = torch.tensor([_padded(range(start, start + len(w)), T, -1) for w, start in zip(windows, starts)],
                                 dtype=torch.int64)  # [B, T]
        num_draft = torch.tensor([len(s.drafts) if s.prefilled else 0 for s in rows], dtype=torch.int64)  # [B]
        top_ids = top_probs = None
        sampled = [s for s in rows if s.prefilled and s.draft_top_ids is not None]
        if sampled:
            K, N = int(num_draft.max()), sampled[0].draft_top_ids.shape[-1]
            top_ids = torch.zeros(B, K, N, dtype=torch.int64)  # [B, K, N]
            top_probs = torch.zeros(B, K, N, dtype=torch.float32)  # [B, K, N]
            for b, s in enumerate(rows):
                if s in sampled:
                    top_ids[b, : len(s.drafts)] = s.draft_top_ids
                    top_probs[b, : len(s.drafts)] = s.draft_top_probs
        new = [not s.prefilled for s in rows]
        params = _row_params(rows, new)
        batch = TargetBatch(**params, token_ids=token_ids, positions=positions, num_draft=num_draft,
                            draft_top_ids=top_ids, draft_top_probs=top_probs)
        return batch, starts, None if any(new) else params  # the next call over these rows has none new: built again

    def _chains(self, rows: list[_Sequence], emitted: list[int]) -> bool:
        """Whether a target call over `rows` can draft their next window on the device: every row decodes
        greedily with its full num_draft_tokens drafts (the next window drafts as many) and has no MTP pairs
        waiting, drafting is on at this many rows, and each row's next window still fits its KV cache
        (max_seq_len) after the calls before it emit `emitted` (at most) of its tokens, so the host need not
        know how many they emit. Near max_tokens a row keeps drafting in full: what it emits past max_tokens
        is cut (`_emit`), and its statistics count the drafts it was allowed (`_accept`)."""
        if not self._chain or self._spec_disable_rows and len(self._live) > self._spec_disable_rows:
            return False  # (the live rows, as the step counts them: with prompts apart, more than `rows`)
        return all(s.prefilled and len(s.drafts) == s.request.num_draft_tokens > 0 and not s.absorb_tokens
                   and s.request.temperature < GREEDY_TEMPERATURE
                   and len(s.tokens) + n + s.request.num_draft_tokens <= self._limits.max_seq_len
                   for s, n in zip(rows, emitted))

    def _launch_chained(self, rows: list[_Sequence], batch: TargetBatch, params: dict[str, torch.Tensor] | None,
                        starts: list[int], ahead: bool) -> _Launched:
        pending = self._timed("target", self._hops.launch_chained, batch)
        self.metrics.hop()  # a target call and an mtp call in one launch
        self.metrics.hop()
        self.metrics.launched(chained=True, ahead=ahead)
        return _Launched(pending, rows, starts, params, chained=True)

    def _complete(self, call: _Launched) -> None:
        """Launch the next step's call first when it can go ahead, then read `call`'s results and accept them
        for its rows still live (the prompts launched before it first: the next call counts their tokens)."""
        if call.prompts is not None:
            self._accept_all(call.prompts, self._timed("target", call.prompts.pending.read))
        self._ahead = self._go_ahead(call)
        result = self._timed("target", call.pending.read)
        if self._drain_responses is not None:  # the previous step's responses went out during the hops
            self._timed("respond", self._drain_responses)
        self._accept_all(call, result)

    def _accept_all(self, call: _Launched, result: HostResult) -> None:
        num_accepted, output_ids, logprobs = result.num_accepted, result.output_ids, result.logprobs  # [B], [B][K+1] x2
        self._last_hidden = hop = _StepHidden(result.hidden)  # [B, T, H]
        next_drafts = result.draft_ids if call.chained else None  # [B][K']: the next window's drafts
        live = set(self._live)
        for b, s in enumerate(call.rows):
            if s not in live:  # finished or failed while the call ran
                continue
            try:
                self._accept(s, num_accepted[b], output_ids[b], logprobs[b], hop, b, call.starts[b],
                             next_drafts and next_drafts[b][: s.request.num_draft_tokens])
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                self._fail(s, f"spec_decode: {type(exc).__name__}: {exc}")

    def _go_ahead(self, call: _Launched) -> _Launched | None:
        """The next step's target call over `call`'s rows, launched with the tokens `call` emits as its input
        before they reach the host, when `call` verified no drafts (each row emits one token) and the next step
        drafts for none of them (plain rows, or more rows than `spec_disable_rows`). Rows that certainly finish
        with `call` (max_tokens) are left out; those that stop on EOS or a stop word get a call whose result is
        never read. With `separate_prefill`, requests waiting for a free slot are admitted on the way
        (`_prompts_ahead`), so the device does not wait for the host to admit them."""
        live = set(self._live)
        if not self._overlap or not live <= set(call.rows):
            return None  # some live row is not in `call` (prefilled apart): the next step steps every row
        with self._cond:
            incoming = list(itertools.islice(self._waiting, self.slots.num_free))
        if incoming and (call.chained or not self._separate_prefill):  # admitted once the rows run one call at a time
            return None
        if call.chained:
            return self._chain_ahead(call)
        if any(s.drafts for s in call.rows):
            return None
        # a row that finished is left out: its slot may be given to a new row here
        index = [b for b, s in enumerate(call.rows)
                 if s in live and len(s.output_ids) + call.steps < s.request.max_tokens]
        rows = [call.rows[b] for b in index]
        if not rows:
            return None
        drafting_off = self._spec_disable_rows and len(rows) + len(incoming) > self._spec_disable_rows
        if not drafting_off and (any(_drafts_after(s.request, len(s.output_ids) + call.steps - 1) for s in rows)
                                 or any(_drafts_after(w.request, 0) for w in incoming)):
            return None
        token_ids = call.pending.next_ids  # [B, 1] on the device: maybe a graph's buffer, which the prompts' call
        if len(rows) < len(call.rows):  # may write (`PendingTarget`): taken first
            token_ids = token_ids.index_select(0, _on_device(index, token_ids.device))  # [B', 1]
        elif incoming:
            token_ids = token_ids.clone()
        prompts, new, new_ids = self._prompts_ahead(len(incoming)) if incoming else (None, [], None)
        if new:
            rows, token_ids = rows + new, torch.cat([token_ids, new_ids])  # [B' + N', 1]
        # where the last token `call` (or its prompt) emits goes: `call` emits call.steps tokens a row
        starts = [len(s.tokens) + call.steps - 1 for s in rows[: len(index)]] + [len(s.tokens) for s in new]
        params = _next_params(call, rows)
        batch = TargetBatch(**params, token_ids=token_ids,  # host tensors over numpy: no torch op (transfers.py)
                            positions=torch.from_numpy(np.array(starts, dtype=np.int64).reshape(-1, 1)),  # [B', 1]
                            num_draft=torch.from_numpy(np.zeros(len(rows), dtype=np.int64)))  # [B']
        return self._launch_target(rows, batch, starts, params, ahead=True, prompts=prompts,
                                   steps=self._steps(rows, starts))  # pairs wait for drafting

    def _prompts_ahead(self, count: int) -> tuple[_Launched | None, list[_Sequence], torch.Tensor | None]:
        """Admit up to `count` waiting requests and launch their prompts in a call of their own, before the next
        step's call over the decoding rows, which takes the first token of each prompt where this call leaves it
        (`_complete` reads this call first). Returns the call, the new rows that go on decoding (a request of one
        token finishes with its prompt) and their first tokens [N', 1] on the device."""
        new = self._admit(count)
        if not new:  # all cancelled while waiting
            return None, [], None
        prompts = self._launch_target(new, *self._target_batch(new), ahead=True)
        index = [b for b, s in enumerate(new) if s.request.max_tokens > 1]
        first_ids = prompts.pending.next_ids  # [N, 1]
        if len(index) < len(new):
            first_ids = first_ids.index_select(0, _on_device(index, first_ids.device)) if index else None  # [N', 1]
        return prompts, [new[b] for b in index], first_ids

    def _chain_ahead(self, call: _Launched) -> _Launched | None:
        """The next chained call over `call`'s rows still live, launched with the window `call` drafts as its
        input before it reaches the host, when each row's window still fits its cache after both calls (`_chains`)."""
        live = set(self._live)  # rows that certainly finish with `call` (max_tokens) are left out
        index = [b for b, s in enumerate(call.rows) if s in live and len(s.output_ids) + 1 < s.request.max_tokens]
        rows = [call.rows[b] for b in index]
        # `call` emits at most len(drafts) + 1 tokens, the next call num_draft_tokens + 1
        if not rows or not self._chains(rows, [len(s.drafts) + s.request.num_draft_tokens + 2 for s in rows]):
            return None
        token_ids, positions = call.pending.next_ids, call.pending.next_positions  # [B, K'+1] x2 on the device
        if len(rows) < len(call.rows):
            kept = _on_device(index, token_ids.device)  # [B']
            token_ids, positions = token_ids.index_select(0, kept), positions.index_select(0, kept)  # [B', K'+1] x2
        num_draft = torch.from_numpy(np.array([s.request.num_draft_tokens for s in rows], dtype=np.int64))  # [B']
        params = _next_params(call, rows)
        batch = TargetBatch(**params, token_ids=token_ids, positions=positions, num_draft=num_draft)
        return self._launch_chained(rows, batch, params, [-1] * len(rows), ahead=True)  # where each window starts: on the device

    def _accept(self, s: _Sequence, num_accepted: int, output_ids: list[int], logprobs: list[float],
                hop: _StepHidden, row: int, start: int, next_drafts: list[int] | None = None) -> None:
        """Record one target result for one sequence, row `row` of the hop; output_ids [K+1], logprobs [K+1].
        `next_drafts`: the next window's drafts where the call chained (its pairs went to the MTP on the device)."""
        new_ids = output_ids[: num_accepted + 1]
        new_logprobs = logprobs[: num_accepted + 1]
        if s.prefilled:
            # drafts past max_tokens (a chained window drafts in full; `_emit` stops there) are not counted
            k = min(len(s.drafts), s.request.max_tokens - len(s.output_ids) - 1)
            if k:
                accepted = min(num_accepted, k)
                s.total_draft_tokens += k
                s.total_accepted_draft_tokens += accepted
                for position in range(accepted):
                    s.accepted_per_position[position] += 1
                self.metrics.draft(k, accepted)
            pairs = (new_ids, (hop, row, num_accepted + 1), start)  # i = start .. start + num_accepted
        else:
            pairs = (s.tokens[1:] + new_ids[:1], (hop, row, len(s.tokens)), 0)  # the shifted prompt
            s.prefilled = True
        if s.request.num_draft_tokens and next_drafts is None:
            s.pend(*pairs)
        s.drafts, s.draft_top_ids, s.draft_top_probs = next_drafts or [], None, None
        self.metrics.emitted(self._emit(s, new_ids, new_logprobs))
        if s.finish_reason:
            self._finish(s)
        elif s.request.stream and (s.num_sent == 0 or len(s.output_ids) - s.num_sent >= self._stream_interval):
            self._timed("respond", s.handle.send, self._response(s), False)

    def _emit(self, s: _Sequence, new_ids: list[int], new_logprobs: list[float]) -> int:
        """Append tokens until EOS, a stop word or max_tokens; returns how many were appended."""
        emitted = 0
        for token, logprob in zip(new_ids, new_logprobs):
            if token == self._limits.eos_token_id:
                s.finish_reason = "stop"
                break
            s.tokens.append(token)
            s.output_ids.append(token)
            s.logprobs.append(logprob)
            emitted += 1
            if s.text_stream is not None:
                searched = len(s.text)
                s.text += s.text_stream.step(token)
                if s.request.stop_words and self._cut_at_stop_word(s, searched):
                    s.finish_reason = "stop"
                    break
            if len(s.output_ids) == s.request.max_tokens:
                s.finish_reason = "length"
                break
        return emitted

    # ---- responses -----------------------------------------------------------------------------
    @staticmethod
    def _cut_at_stop_word(s: _Sequence, searched: int) -> bool:
        """Whether a stop word ends in the text past `searched` characters (none starts before it)."""
        start = max(0, searched - max(len(w) for w in s.request.stop_words) + 1)
        hits = [i for i in (s.text.find(w, start) for w in s.request.stop_words) if i >= 0]
        if hits:
            s.stop_text = s.text[: min(hits)]
        return bool(hits)

    def _text(self, s: _Sequence, final: bool) -> str:
        """Text not sent yet; while streaming, hold back a stop-word prefix (the text stream holds back an
        incomplete character). The final response decodes the whole output once, incomplete bytes and all."""
        if self._tokenizer is None:
            return ""
        if s.stop_text is not None:
            text = s.stop_text
        elif final:
            text = self._tokenizer.decode(s.output_ids)
        else:
            text = s.text
            for word in s.request.stop_words:
                for n in range(min(len(word) - 1, len(text)), 0, -1):
                    if text.endswith(word[:n]):
                        text = text[:-n]
                        break
        if not text.startswith(s.text_sent):
            return ""
        delta, s.text_sent = text[len(s.text_sent):], text
        return delta

    def _response(self, s: _Sequence, final: bool = False) -> GenerationResponse:
        """The tokens not sent yet (with a non-streamed request: the whole output, at the end)."""
        ids, logprobs = s.output_ids[s.num_sent:], s.logprobs[s.num_sent:]
        s.num_sent = len(s.output_ids)
        return GenerationResponse(
            text_output=self._text(s, final),
            output_ids=ids,
            logprobs=logprobs if s.request.return_logprobs else None,
            finish_reason=s.finish_reason if final else "",
            num_input_tokens=len(s.request.input_ids),
            num_output_tokens=len(s.output_ids),
            total_draft_tokens=s.total_draft_tokens,
            total_accepted_draft_tokens=s.total_accepted_draft_tokens,
            accepted_per_position=list(s.accepted_per_position),
        )

    def _cancelled_response(self, request: GenerationRequest) -> GenerationResponse:
        return GenerationResponse("", [], [] if request.return_logprobs else None, "cancelled",
                                  len(request.input_ids), 0, 0, 0, [0] * request.num_draft_tokens)

    def _finish(self, s: _Sequence) -> None:
        self._release(s)
        self.metrics.finish(s.finish_reason)
        response = self._response(s, final=True)
        try:
            self._timed("respond", s.handle.send, response, True)
        except Exception:  # noqa: BLE001 - the client is gone; nothing is left to tell it
            pass

    def _fail(self, s: _Sequence, message: str, reason: str = "error") -> None:
        if s in self._live:
            self._release(s)
        self.metrics.finish(reason)
        try:
            s.handle.send_error(message)
        except Exception:  # noqa: BLE001 - the client is gone; nothing is left to tell it
            pass

    def _release(self, s: _Sequence) -> None:
        """Free the slot and publish the gauges before the final response: a client reading them after it
        sees the slot free."""
        self._live.remove(s)
        self.slots.release(s.slot)
        self.metrics.occupancy(len(self._live), self.slots.num_free, len(self._waiting))

    def _publish(self) -> None:
        self.metrics.occupancy(len(self._live), self.slots.num_free, len(self._waiting))
        if self._live or self._waiting:
            self.metrics.flush_if_due()
        else:  # idle: the counters are exact until the next request
            self.metrics.flush()
