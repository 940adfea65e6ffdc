"""CUDA graphs for the decode-time calls of the `target` and `mtp` workers, by batch-size bucket.

A decode step of a small model is bound by kernel launches, not by the GPU: on the H200 the bundled
model decodes in 1.34 ms per token when its step is one captured graph (bench/standalone.py) and in
15 ms through Triton when every kernel is launched from Python (docs/benchmarks.md). So, as vLLM
and SGLang do, calls whose shape fits — B rows <= the largest bucket, T tokens <= a width W (the
verify window max_draft_tokens + 1 for `target`; max_draft_tokens + num_mtp_layers for `mtp`) — are
padded to (bucket(B), W) and replayed from a graph captured at load; larger calls (prompt prefill)
run eager. Padding is harmless: padded tokens carry position -1, which
writes the pool's scratch position and is never attended (export/mla.py), and padded rows use slot 0.
It is not free: padded tokens run through every layer, and in a MoE they route to experts whose
weights the step then reads. So `target` also has a one-token family, which plain decoding (and
steps that skip drafting) replays instead of a W-token window, as the standalone loop does.

A graph holds as much of a worker's call as is a function of tensors, not just the model: `target`'s
holds greedy verification (`workers.verify_window`), and argmax drafting is one graph per draft count
K (`workers.draft_chain`, its K MTP calls and the ops between them), so a greedy decode step launches
two graphs and few kernels besides. A chained step's work after its verify (absorbing the accepted pairs,
drafting the next window, packing the results: `workers.chained_draft`) is one graph per bucket and K that
reads the verify graph's buffers where they are (`GraphedChain`): nothing is copied between the two. Sampled steps draw between calls and replay the per-layer `mtp`
graphs.

The host's work per replay is kept to a few torch calls, each of which lets go of the GIL (transfers.py):
a graph's int64 inputs are views of one buffer, which the inputs given on the host fill with one copy,
written with numpy (`_GraphedStep._stage`); `GraphedTarget.place` writes them before the call, so that
work chained on the call reads them where they are; and the target's greedy results leave as one tensor
(`workers.window_results`).

Graphs of one worker share one memory pool for their intermediates (captured largest first): they
never run at once, and callers read the outputs before the next replay. Each bucket keeps its own
static inputs and outputs, about 4 · b · W · (V + H) bytes per bucket b: for a 129k vocabulary, 64
slots and W = 5, about 350 MB for the target's buckets together, and a fifth of that again for its
one-token family. The chained graphs have a pool of their own (`GraphedChain`): one output of theirs is
read after other graphs of the MTP's pool may have run.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from triton_mtp.serving.requests import flag_parameter
from triton_mtp.serving.transfers import TO_DEVICE, to_device
from triton_mtp.serving.workers import chained_draft, draft_chain, multi_step, verify_window

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
Step = Callable[..., tuple[torch.Tensor, ...]]


def static_inputs(example_inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None,
                                                                    list[tuple[int, int] | None]]:
    """Static copies of `example_inputs` for a replay to read, the int64 ones side by side in one buffer (a
    call writes them from the host with one copy): the copies, that buffer (None without int64 inputs) and
    each copy's span [start, end) in it (None: a tensor of its own)."""
    ids = [x for x in example_inputs if x.dtype == torch.int64]
    packed = torch.cat([x.reshape(-1) for x in ids]) if ids else None  # [n]
    copies, spans, start = [], [], 0
    for x in example_inputs:
        if x.dtype == torch.int64:
            copies.append(packed[start: start + x.numel()].view(x.shape))
            spans.append((start, start + x.numel()))
            start += x.numel()
        else:
            copies.append(x.clone())
            spans.append(None)
    return copies, packed, spans


class _StaticReplay:
    """A step over static input buffers: `replay()` runs on what `inputs` hold, a call copies into them first.
    The int64 inputs are views of one buffer, `packed`, at their `spans` in it (`static_inputs`)."""

    inputs: list[torch.Tensor]
    packed: torch.Tensor | None
    spans: list[tuple[int, int] | None]

    def replay(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def span(self, start: int, end: int) -> torch.Tensor:
        """packed[start:end], made once (a slice is a torch call, which lets go of the GIL: transfers.py)."""
        spans = self.__dict__.setdefault("_span_views", {})
        if (start, end) not in spans:
            spans[start, end] = self.packed[start:end]
        return spans[start, end]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        return self.replay()


class CapturedStep(_StaticReplay):
    """One CUDA graph of `step` over static copies of `example_inputs` (warmed up on a side stream).

    Outputs live in the graph's static buffers: a caller that keeps one past the next replay clones it.
    """

    def __init__(self, step: Step, example_inputs: Sequence[torch.Tensor], warmup: int = 2, pool=None) -> None:
        self.inputs, self.packed, self.spans = static_inputs(example_inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warmup):
                step(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
            self.outputs = step(*self.inputs)

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


class EagerReplay(_StaticReplay):
    """The `CapturedStep` contract without a graph: static inputs, the step run on them (CPU, tests); `outputs`
    are the last replay's."""

    outputs: tuple[torch.Tensor, ...] | None = None

    def __init__(self, step: Step, example_inputs: Sequence[torch.Tensor], pool=None) -> None:
        self.step = step
        self.inputs, self.packed, self.spans = static_inputs(example_inputs)

    def replay(self) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            self.outputs = self.step(*self.inputs)
        return self.outputs


class GraphMismatch(RuntimeError):
    """A replay's outputs differ from the eager step's."""


def _compare(name: str, expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor], tolerance: float) -> None:
    """GraphMismatch naming the graph and output where a replay's outputs differ from eager's: floating point by
    relative error, ids and counts exactly."""
    for n, (e, g) in enumerate(zip(expected, got)):
        if e.is_floating_point():
            error = float((g.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1e-6))
            wrong = f"max relative error {error:.2e} > {tolerance:.0e}" if not error <= tolerance else ""
        else:
            wrong = "" if torch.equal(g, e) else f"{int((g != e).sum())} ids differ"
        if wrong:
            raise GraphMismatch(f"CUDA graph of {name} differs from eager in output {n}: {wrong}")


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below `max_batch`, then `max_batch`."""
    return [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]


@dataclass(frozen=True)
class _Input:
    """One static input of a graph family: [b] per row, or [b, W] per token ([b, W, H] for a hidden state)."""

    dtype: torch.dtype | None = torch.long  # None: a hidden state, [b, W, H] of the wrapper's (H, dtype)
    per_token: bool = True
    pad: int | None = 0  # value of padding entries; None: stale values (padded rows' outputs are dropped)


TOKEN_IDS, POSITIONS, HIDDEN = _Input(), _Input(pad=-1), _Input(None, pad=None)
SLOT_IDS = NUM_DRAFT = _Input(per_token=False)  # padded rows: slot 0, no drafts


class _GraphedStep:
    """Pads fitting calls to a bucket and replays its graph; `key` selects among graph families."""

    inputs: tuple[_Input, ...]

    def __init__(self, step: Step, max_batch: int, width: int, device: torch.device,
                 keys: Sequence[int | None], hidden: tuple[int, torch.dtype] | None,
                 graph: Callable[..., Step], pool=None) -> None:
        self.step, self.width, self.device, self.hidden = step, width, torch.device(device), hidden
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[tuple[int | None, int], Step] = {}
        with self.on_device():
            if pool is None and self.device.type == "cuda":
                pool = torch.cuda.graph_pool_handle()
            self.pool = pool  # another wrapper of the same worker may capture into it
            for key in keys:
                for b in reversed(self._buckets(key)):  # largest first: later captures reuse the pool's blocks
                    self.graphs[key, b] = graph(self._bound(key), self._example(b, key), pool=pool)

    def on_device(self) -> contextlib.AbstractContextManager:
        """Make `device` the current CUDA device: streams, captures and replays use the current one, which
        is per thread and need not be this model instance's GPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _bound(self, key: int | None) -> Step:
        raise NotImplementedError

    def _buckets(self, key: int | None) -> list[int]:
        """The batch buckets of family `key`."""
        return self.buckets

    def widths(self) -> list[int]:
        """The token widths its graphs take."""
        return sorted({self._width(key) for key, _ in self.graphs})

    def captured(self) -> str:
        """What the graphs cover, for the load log."""
        return f"batch sizes {self.buckets} x {' and '.join(str(w) for w in self.widths())} tokens"

    def _width(self, key: int | None) -> int:
        """Tokens of the graphs of family `key`."""
        return self.width

    def _checked(self, key: int | None, inputs: list[torch.Tensor]) -> None:
        """Set what the check needs beyond token ids 1 and random hidden states (in place)."""

    def check_against_eager(self, tolerance: float = 5e-2) -> None:
        """Replay every graph on inputs unlike its capture example and compare its outputs with the eager
        step's (floating point: by relative error; ids and counts: exactly).

        Token ids 1 (and random hidden states) rather than the capture's zeros, so a graph that captured
        nothing (it would return the capture-time outputs) fails. Every position is -1: the check writes
        only the scratch position and leaves the KV pool as it found it. RuntimeError naming the graph
        when one disagrees.
        """
        self._check(self.graphs, tolerance)

    def _check(self, graphs: dict[tuple[int | None, int], _StaticReplay], tolerance: float) -> None:
        generator = torch.Generator(device=self.device).manual_seed(0)
        with self.on_device():
            for (key, b), replay in graphs.items():
                inputs = self._example(b, key)
                inputs[0].fill_(1)
                for spec, x in zip(self.inputs, inputs):
                    if spec.dtype is None:
                        x.normal_(generator=generator)
                self._checked(key, inputs)
                with torch.no_grad():
                    expected = self._bound(key)(*inputs)
                _compare(f"{self.name(key)} (batch {b})", expected, replay(*inputs), tolerance)

    def name(self, key: int | None = None) -> str:
        raise NotImplementedError

    def _example(self, b: int, key: int | None) -> list[torch.Tensor]:
        """Inputs of family `key`, bucket b: every token padding (position -1), as a padded call sends them."""
        examples = []
        for spec in self.inputs:
            shape = (b, self._width(key)) if spec.per_token else (b,)
            if spec.dtype is None:
                size, dtype = self.hidden
                examples.append(torch.zeros(*shape, size, dtype=dtype, device=self.device))
            else:
                examples.append(torch.full(shape, spec.pad, dtype=spec.dtype, device=self.device))
        return examples

    def _fits(self, token_ids: torch.Tensor) -> bool:
        B, T = token_ids.shape
        return 0 < B <= self.buckets[-1] and T <= self.width

    def bucket(self, B: int, key: int | None = None) -> int:
        """The batch size a call of B rows of family `key` is padded to: the smallest bucket >= B."""
        return next(size for size in self._buckets(key) if size >= B)

    def _graph(self, key: int | None, B: int) -> _StaticReplay:
        """The graph of family `key` that a call of B rows replays."""
        return self.graphs[key, self.bucket(B, key)]

    def _replay(self, key: int | None, given: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Pad to the smallest bucket >= B and the family's width and replay: the graph's own output
        buffers, whose first B rows are the call's. Inputs that `place` put there already are not copied."""
        graph = self._graph(key, given[0].shape[0])
        placed, self._placed = self._placed, None
        if placed is None or any(x is not p for x, p in zip(given, placed)):
            self._write(graph, given)
        with self.on_device():
            return graph.replay()

    _placed: list[torch.Tensor] | None = None  # what the last `place` returned, until the call that takes it

    def _write(self, graph: _StaticReplay, given: Sequence[torch.Tensor]) -> None:
        """Copy a call's inputs (host or device tensors) into `graph`'s static inputs, padded: the int64 ones
        given on the host with one transfer (`_stage`), each other one with a copy of its own."""
        B, T = given[0].shape
        staged = self._stage(graph, given)
        for i, (spec, static, x) in enumerate(zip(self.inputs, graph.inputs, given)):
            if i in staged:
                continue
            if x.shape == static.shape:  # no padding to write: one copy
                static.copy_(x)
                continue
            if spec.pad is not None:
                static.fill_(spec.pad)
            if spec.per_token:
                static[:B, :T] = x
            else:
                static[:B] = x

    def _stage(self, graph: _StaticReplay, given: Sequence[torch.Tensor]) -> list[int]:
        """Write the int64 inputs given on the host into `graph`'s packed inputs (`static_inputs`), padded, with
        numpy (no torch call each) and one copy to the device, where they are one span of it (those given on
        the device come first: the tokens, or the window, a call launched ahead takes from the call before
        it). Returns the inputs written."""
        host = [i for i, x in enumerate(given) if graph.spans[i] is not None and x.device.type == "cpu"]
        if not host:
            return host
        start, end = min(graph.spans[i][0] for i in host), max(graph.spans[i][1] for i in host)
        if end - start != sum(graph.spans[i][1] - graph.spans[i][0] for i in host):
            return []  # not one span: copied one by one
        B, T = given[0].shape
        with self._staging(graph, start, end) as array:  # int64 [end - start]
            for i in host:
                spec, (first, last), x = self.inputs[i], graph.spans[i], given[i].numpy()
                view = array[first - start: last - start].reshape(graph.inputs[i].shape)
                if x.shape == view.shape:
                    view[...] = x
                    continue
                view.fill(spec.pad)
                if spec.per_token:
                    view[:B, :T] = x
                else:
                    view[:B] = x
        return host

    @contextlib.contextmanager
    def _staging(self, graph: _StaticReplay, start: int, end: int):
        """An int64 numpy array whose values end up in graph.packed[start:end]: that memory itself on the host,
        else a pinned buffer copied there once written (the stream orders the copy before the replay)."""
        if self.device.type != "cuda":
            yield graph.packed.numpy()[start:end]
            return
        with TO_DEVICE.take(8 * (end - start), torch.cuda.current_stream(self.device)) as slot:
            yield slot.array[: 8 * (end - start)].view(np.int64)
            graph.span(start, end).copy_(slot.view(torch.int64, (end - start,)), non_blocking=True)


def _leading(buffer: torch.Tensor, rows: int, columns: int | None = None) -> torch.Tensor:
    """buffer[:rows, :columns], or the buffer itself where that is all of it (no view to make per call)."""
    if buffer.shape[0] == rows and (columns is None or buffer.shape[1] == columns):
        return buffer
    return buffer[:rows] if columns is None else buffer[:rows, :columns]


def target_width(max_draft_tokens: int) -> int:
    """Tokens of `target`'s widest decode call: the verify window [last token, k drafts]."""
    return max_draft_tokens + 1


def mtp_width(max_draft_tokens: int, num_layers: int) -> int:
    """Tokens of `mtp`'s widest decode call: a layer's first drafting call absorbs up to k + 1 accepted
    pairs, then the num_layers - 1 chained drafts before it."""
    return max_draft_tokens + num_layers


def prefill_widths(width: int, prefill_tokens: int) -> list[int]:
    """The token widths of `target`'s prompt families: powers of two from 16, wider than the verify window,
    up to `prefill_tokens`."""
    return [w for w in (1 << i for i in range(4, max(prefill_tokens, 1).bit_length())) if width < w <= prefill_tokens]


def prompt_buckets(max_batch: int, width: int, prefill_tokens: int) -> dict[int, list[int]]:
    """The batch buckets each prompt family (`prefill_widths`) captures: those of at most `prefill_tokens` tokens."""
    buckets = batch_buckets(max_batch)
    return {w: [b for b in buckets if b * w <= prefill_tokens] for w in prefill_widths(width, prefill_tokens)}


class _GraphedWindow(_GraphedStep):
    """A window step of the target (`workers.WindowStep`) with graphs by family: `place` puts a call's inputs where
    the graph it replays reads them."""

    inputs = (TOKEN_IDS, POSITIONS, SLOT_IDS, NUM_DRAFT)

    def family(self, B: int, T: int) -> int | None:
        """The family that a call of B rows of T tokens replays, None for none (it runs eager)."""
        raise NotImplementedError

    def place(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
              num_draft: torch.Tensor) -> list[torch.Tensor]:
        """A call's inputs (host or device tensors) on the device: written into the static inputs of the graph
        the call replays, which it then copies nothing into (pass the tensors returned), or moved
        (`transfers.to_device`) for a call that runs eager. Valid until the next call."""
        B, T = token_ids.shape
        key = self.family(B, T)
        if key is None:
            return to_device([token_ids, positions, slot_ids, num_draft], self.device)
        graph = self._graph(key, B)
        given = (token_ids, positions, slot_ids, num_draft)
        self._write(graph, given)
        self._placed = [_leading(static, B, T if spec.per_token else None)
                        for spec, static in zip(self.inputs, graph.inputs)]
        return self._placed


class GraphedTarget(_GraphedWindow):
    """A `workers.verify_window` step with graphs for B <= max_batch rows of one token or of T <= width
    tokens, and, with `prefill_tokens`, for prompts: calls of B rows of T <= P tokens (P a power of two
    `prefill_widths` gives) where B·P <= prefill_tokens. The family key is its width.

    A graph holds the target call and greedy verification (window width - 1 drafts, wider than a call's
    K is harmless: `verify_window`), so a greedy decode step launches one graph. The outputs are the
    graph's buffers (the first B rows, K + 1 columns): read them before the next call. A prompt's graph
    replaces a compiled step run from Python, hundreds of kernel launches each holding the GIL a while
    (docs/benchmarks.md, run 29: 9% of the engine thread's time at 32 streams), and shortens the time to
    first token; its padding runs through the model like any other token.
    """

    def __init__(self, window: Step, max_batch: int, width: int, device: torch.device,
                 graph: Callable[..., Step] = CapturedStep, prefill_tokens: int = 0) -> None:
        if prefill_tokens < 0:
            raise ValueError(f"prefill_graph_tokens: must be >= 0, got {prefill_tokens}")
        self.prefill_tokens = prefill_tokens
        self._prompt_buckets = prompt_buckets(max_batch, width, prefill_tokens)
        self.prefill = list(self._prompt_buckets)
        super().__init__(window, max_batch, width, device, sorted({1, width, *self.prefill}, reverse=True), None,
                         graph)  # widest first

    def _buckets(self, key: int | None) -> list[int]:
        return self._prompt_buckets.get(key, self.buckets)

    def family(self, B: int, T: int) -> int | None:
        if T <= self.width:
            return (1 if T == 1 else self.width) if 0 < B <= self.buckets[-1] else None
        return next((w for w in self.prefill if T <= w and B <= self._buckets(w)[-1]), None)

    def widths(self) -> list[int]:
        return sorted({1, self.width})

    def _width(self, key: int | None) -> int:
        return key

    def _drafts(self, key: int) -> int:
        """The drafts K a family verifies: none for one token, the window's for the others."""
        return min(key, self.width) - 1

    def _bound(self, key: int | None) -> Step:
        K = self._drafts(key)
        return lambda token_ids, positions, slot_ids, num_draft: self.step(token_ids, positions, slot_ids, num_draft, K)

    def _checked(self, key: int | None, inputs: list[torch.Tensor]) -> None:
        inputs[-1].fill_(self._drafts(key))  # every row "verifies" a full window of drafts

    def name(self, key: int | None = None) -> str:
        if key is not None and key > self.width:
            return f"the {key}-token prompt target"
        return "target" if key is None else f"the {key}-token target"

    def check_against_eager(self, tolerance: float = 5e-2) -> None:
        """As every graph family's (RuntimeError when a decode graph disagrees), except that prompt graphs which
        disagree are dropped, prompts then running eager (`prefill_off` says why), and the decode graphs kept."""
        prompts = {key: graph for key, graph in self.graphs.items() if key[0] > self.width}
        try:
            self._check(prompts, tolerance)
        except GraphMismatch as exc:  # (any other failure, out of memory say, fails the whole check)
            self.prefill, self.prefill_off = [], str(exc)
            for key in prompts:
                del self.graphs[key]
        self._check({key: graph for key, graph in self.graphs.items() if key not in prompts}, tolerance)

    prefill_off = ""  # why the prompt graphs were dropped at the check, if they were

    def captured(self) -> str:
        """What the graphs cover, for the load log."""
        prompts = f"; prompts of up to {self.prefill[-1]} tokens, {self.prefill_tokens} a call" if self.prefill else ""
        off = f"; prompt graphs off, prompts run eager: {self.prefill_off}" if self.prefill_off else ""
        return super().captured() + prompts + off

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 num_draft: torch.Tensor, K: int, greedy: bool = True) -> tuple[torch.Tensor, ...]:
        """As `verify_window`'s step; a replay computes the greedy verification whatever `greedy` says, and its
        `window_results` are as wide as the graph's window (results past K + 1 are padding: ids -1)."""
        B, T = token_ids.shape
        key = self.family(B, T)
        if key is None or K > self._drafts(key):  # (more drafts than the window: a prompt family would cut them)
            return self.step(*to_device([token_ids, positions, slot_ids, num_draft], self.device), K, greedy)
        window_logits, draft_ids, num_accepted, output_ids, logprobs, hidden, results = self._replay(
            key, (token_ids, positions, slot_ids, num_draft))
        return (_leading(window_logits, B, K + 1), _leading(draft_ids, B, K), _leading(num_accepted, B),
                _leading(output_ids, B, K + 1), _leading(logprobs, B, K + 1), _leading(hidden, B, T),
                _leading(results, B))


class GraphedSteps(_GraphedWindow):
    """`workers.multi_step` over the target: N greedy one-token calls in a row, one graph per bucket (multi-step
    decoding: one replay's host work for N tokens of every row), captured in the target graphs' pool. The family key
    is N. Calls of more rows than the largest bucket run `fallback`, `multi_step` over the target's graphs (which run
    such calls eager too); where this wrapper fails its check at load, every call runs that fallback: N replays of
    the one-token graphs."""

    def __init__(self, steps: Step, fallback: Step, count: int, max_batch: int, device: torch.device,
                 graph: Callable[..., Step] = CapturedStep, pool=None) -> None:
        super().__init__(steps, max_batch, 1, device, [count], None, graph, pool)
        self.fallback, self.count = fallback, count

    def family(self, B: int, T: int) -> int | None:
        return self.count if T == 1 and 0 < B <= self.buckets[-1] else None

    def _bound(self, key: int | None) -> Step:
        return lambda *inputs: self.step(*inputs, 0, True)[1:]  # (window_logits is None: no row samples)

    def name(self, key: int | None = None) -> str:
        return f"the {self.count}-step target"

    def captured(self) -> str:
        return f"batch sizes {self.buckets} x {self.count} one-token steps"

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 num_draft: torch.Tensor, K: int = 0, greedy: bool = True) -> tuple[torch.Tensor | None, ...]:
        """As `workers.multi_step`'s step."""
        B = token_ids.shape[0]
        if self.family(B, token_ids.shape[1]) is None:
            return self.fallback(token_ids, positions, slot_ids, num_draft, K, greedy)
        outputs = self._replay(self.count, (token_ids, positions, slot_ids, num_draft))
        return (None, *(_leading(x, B) for x in outputs))


class GraphedMTP(_GraphedStep):
    """mtp(token_ids, hidden, positions, slot_ids, layer) with graphs per MTP layer for fitting calls."""

    inputs = (TOKEN_IDS, HIDDEN, POSITIONS, SLOT_IDS)

    def __init__(self, step: Step, num_layers: int, max_batch: int, width: int, hidden_size: int,
                 hidden_dtype: torch.dtype, device: torch.device, graph: Callable[..., Step] = CapturedStep) -> None:
        super().__init__(step, max_batch, width, device, range(num_layers), (hidden_size, hidden_dtype), graph)
        self.num_layers = num_layers

    def _bound(self, key: int | None) -> Step:
        return lambda token_ids, hidden, positions, slot_ids: self.step(token_ids, hidden, positions, slot_ids, key)

    def name(self, key: int | None = None) -> str:
        return "mtp" if key is None else f"mtp layer {key}"

    def __call__(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(token_ids):
            return self.step(token_ids, hidden, positions, slot_ids, layer)
        B, T = token_ids.shape
        logits, out = self._replay(layer % self.num_layers, (token_ids, hidden, positions, slot_ids))  # [b, W, V], [b, W, H]
        return logits[:B, :T], out[:B, :T].clone()  # the drafting chain keeps `out` across calls, not the logits


class GraphedDraftChain(_GraphedStep):
    """`workers.draft_chain` with argmax drafts (chain(token_ids, hidden, positions, slot_ids, num_draft, K)),
    one graph per draft count K <= max_draft and bucket: a greedy drafting step launches one graph
    instead of K graphs and the ops between them. Calls that do not fit (prompt absorption) run
    `fallback`. The output is the graph's buffer: read it before the next call."""

    inputs = (TOKEN_IDS, HIDDEN, POSITIONS, SLOT_IDS, NUM_DRAFT)

    def __init__(self, chain: Callable[..., torch.Tensor], fallback: Callable[..., torch.Tensor], max_draft: int,
                 max_batch: int, width: int, hidden_size: int, hidden_dtype: torch.dtype, device: torch.device,
                 graph: Callable[..., Step] = CapturedStep, pool=None) -> None:
        super().__init__(chain, max_batch, width, device, range(1, max_draft + 1), (hidden_size, hidden_dtype), graph,
                         pool)
        self.fallback, self.max_draft = fallback, max_draft

    def _bound(self, key: int | None) -> Step:
        return lambda *inputs: (self.step(*inputs, key),)

    def _checked(self, key: int | None, inputs: list[torch.Tensor]) -> None:
        inputs[-1].fill_(key)  # every row drafts all K: positions stay -1, nothing but scratch is written

    def name(self, key: int | None = None) -> str:
        return "the drafting chain" if key is None else f"the drafting chain (K={key})"

    def __call__(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 num_draft: torch.Tensor, K: int) -> torch.Tensor:
        if not (self._fits(token_ids) and 1 <= K <= self.max_draft):
            return self.fallback(token_ids, hidden, positions, slot_ids, num_draft, K)
        (draft_ids,) = self._replay(K, (token_ids, hidden, positions, slot_ids, num_draft))  # [b, K]
        return draft_ids[: token_ids.shape[0]]


class GraphedChain:
    """What a chained call does after its greedy verify (`workers.chained_draft`: absorb the accepted pairs,
    draft the next window by argmax, the results for the host), one graph per bucket and draft count
    K < `target`'s width, reading the verify graph's inputs and outputs where they are: a chained step
    replays two graphs and copies nothing between them. For a call the verify graphed (`covers`): the
    verify of its bucket just replayed.

    Its graphs share a memory pool of their own: the next window they output is read by the next chained
    call, and a replay of the MTP's graphs in between (a new row's first drafts) would overwrite it in
    theirs, where this capture may have put it in blocks their captures had freed."""

    def __init__(self, target: GraphedTarget, after: Callable[..., tuple[torch.Tensor, ...]],
                 graph: Callable[..., Step] = CapturedStep) -> None:
        self.target, self.after, self.buckets = target, after, target.buckets
        self.graphs: dict[tuple[int, int], _StaticReplay] = {}
        with target.on_device():
            pool = torch.cuda.graph_pool_handle() if target.device.type == "cuda" else None
            for b in reversed(self.buckets):  # as the verify graphs: largest first
                verify = self._verify(b)
                verify.replay()  # outputs that a replay wrote, for the capture's warm-up to read (its inputs are
                # whatever the last call left, at load the check's padding: only scratch is written)
                for K in range(target.width - 1, 0, -1):
                    self.graphs[K, b] = graph(functools.partial(self._after, verify, K), [], pool=pool)

    def _verify(self, b: int) -> _StaticReplay:
        return self.target.graphs[self.target.width, b]

    def _after(self, verify: _StaticReplay, K: int) -> tuple[torch.Tensor, ...]:
        _, positions, slot_ids, num_draft = verify.inputs
        _, _, num_accepted, output_ids, _, hidden, results = verify.outputs
        return self.after(output_ids, num_accepted, hidden, positions, slot_ids, num_draft, results, K)

    def covers(self, token_ids: torch.Tensor, K: int) -> bool:
        """Whether a chained call of `token_ids` [B, T] (K drafts) replayed a window graph of `target`."""
        return self.target.family(*token_ids.shape) == self.target.width > 1 and 1 <= K < self.target.width

    def __call__(self, B: int, K: int) -> tuple[torch.Tensor, ...]:
        """After the verify of B rows: draft_ids [B, K], the next window's ids and positions [B, K+1] and the
        results [B, 2W+1+K], the graph's own buffers (read them before its next replay)."""
        with self.target.on_device():
            outputs = self.graphs[K, self.target.bucket(B)].replay()
        return tuple(_leading(x, B) for x in outputs)

    def check_against_eager(self, tolerance: float = 5e-2) -> None:
        """Replay every graph after random hidden states in its verify graph's outputs, every row drafting K (so a
        graph that captured nothing differs), and compare with eager on the same buffers. Their positions are
        padding (-1): only the scratch position is written."""
        generator = torch.Generator(device=self.target.device).manual_seed(0)
        with self.target.on_device(), torch.no_grad():
            for (K, b), replay in self.graphs.items():
                verify = self._verify(b)
                verify.inputs[1].fill_(-1)  # positions [b, W]
                verify.inputs[3].fill_(K)  # num_draft [b]
                verify.outputs[5].normal_(generator=generator)  # hidden [b, W, H]
                _compare(f"{self.name()} (K={K}, batch {b})", self._after(verify, K), replay.replay(), tolerance)

    def name(self) -> str:
        return "the chained drafting"

    def captured(self) -> str:
        return f"batch sizes {self.buckets} x {self.target.width} tokens"


def target_graphs(runner: Step, max_batch: int, max_draft: int, device: torch.device,
                  graph: Callable[..., Step] = CapturedStep, prefill_tokens: int = 0) -> GraphedTarget:
    """The served target's decode graphs: `workers.verify_window` over `runner`, up to the verify window
    of `max_draft` drafts, and prompt calls of up to `prefill_tokens` tokens."""
    return GraphedTarget(verify_window(runner), max_batch, target_width(max_draft), device, graph, prefill_tokens)


def steps_graphs(target: GraphedTarget, runner: Step, count: int,
                 graph: Callable[..., Step] = CapturedStep) -> GraphedSteps:
    """`count` greedy one-token target steps a replay (`workers.multi_step` over `runner`, the target step that
    `target`'s graphs wrap), in `target`'s memory pool, falling back to `count` replays of `target`'s graphs."""
    return GraphedSteps(multi_step(verify_window(runner), count), multi_step(target, count), count, target.buckets[-1],
                        target.device, graph, target.pool)


def mtp_graphs(runner: Step, num_layers: int, max_batch: int, max_draft: int, hidden_size: int,
               hidden_dtype: torch.dtype, device: torch.device, graph: Callable[..., Step] = CapturedStep) -> GraphedMTP:
    """The served MTP's per-layer decode graphs, up to a layer's widest drafting call."""
    return GraphedMTP(runner, num_layers, max_batch, mtp_width(max_draft, num_layers), hidden_size, hidden_dtype,
                      device, graph)


def draft_chain_graphs(runner: Step, mtp: GraphedMTP, max_draft: int,
                       graph: Callable[..., Step] = CapturedStep) -> GraphedDraftChain:
    """Argmax drafting graphed whole: `workers.draft_chain` over `runner` (the MTP step that `mtp`'s per-layer
    graphs wrap), in `mtp`'s memory pool, falling back to the chain over `mtp` for calls that do not fit."""
    layers, (size, dtype) = mtp.num_layers, mtp.hidden
    return GraphedDraftChain(lambda *inputs: draft_chain(runner, layers, *inputs),
                             lambda *inputs: draft_chain(mtp, layers, *inputs), max_draft, mtp.buckets[-1],
                             target_width(max_draft), size, dtype, mtp.device, graph, mtp.pool)


def chain_graphs(target: GraphedTarget, runner: Step, mtp: GraphedMTP,
                 graph: Callable[..., Step] = CapturedStep) -> GraphedChain:
    """A chained call's work after its verify graphed over `target`'s window graphs: `workers.chained_draft`
    with the argmax chain over `runner` (the MTP step that `mtp`'s per-layer graphs wrap)."""
    after = chained_draft(functools.partial(draft_chain, runner, mtp.num_layers), mtp.hidden[1])
    return GraphedChain(target, after, graph)


def with_decode_graphs(build: Callable[[], _GraphedStep], step: Step, log: Callable[[str], None]) -> Step:
    """`build()` checked against eager, or `step` itself with a log line saying why graphs are off."""
    try:
        graphed = build()
        graphed.check_against_eager()
    except Exception as exc:  # noqa: BLE001 - eager is always a correct fallback
        log(f"CUDA graphs off, running eager: {type(exc).__name__}: {exc}")
        return step
    log(f"CUDA graphs of {graphed.name()} captured for {graphed.captured()}")
    return graphed


# Only the eager format's modules capture. A TorchScript step makes a synchronizing CUDA call (found with
# torch.cuda.set_sync_debug_mode("error") on the H200, bench/capture_check.py), which invalidates any
# capture; ONNX Runtime and AOTInductor launch outside torch's capture.
GRAPH_FORMATS = ("eager",)


def compile_graphs(params: dict[str, str]) -> bool:
    """Whether a graphed model captures torch.compile'd steps (config parameter `compile_graphs`): fused
    kernels make the replayed step faster (docs/benchmarks.md), compiling makes the load minutes longer."""
    return flag_parameter(params, "compile_graphs")


def compile_at_load(params: dict[str, str], device: torch.device, world_size: int) -> bool | None:
    """The `compile` a `target` / `mtp` model loads its steps with: `compile_graphs` when it captures
    decode graphs (graphed, the decode calls launch nothing from Python: compiling pays only for fused
    kernels, on request), else None: the choice the export recorded."""
    return compile_graphs(params) if graphs_wanted(params, device, world_size) else None


def graphs_wanted(params: dict[str, str], device: torch.device, world_size: int) -> bool:
    """Whether a `target` / `mtp` model captures decode graphs: config parameter `cuda_graphs` true (the
    export writes it; a repository from before it has none and runs eager) on a CUDA device, the eager
    format, one rank."""
    return flag_parameter(params, "cuda_graphs") and device.type == "cuda" and world_size == 1 and \
        params.get("format") in GRAPH_FORMATS
