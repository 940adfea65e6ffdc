"""CUDA graphs for the decode-time calls of the `target` and `mtp` workers, by batch-size bucket.

A decode step of a small model is bound by kernel launches, not by the GPU: on the H200 the bundled
model decodes in 1.34 ms per token when its step is one captured graph (bench/standalone.py) and in
15 ms through Triton when every kernel is launched from Python (docs/benchmarks.md). So, as vLLM
and SGLang do, calls whose shape fits — B rows <= the largest bucket, T tokens <= a width W (the
verify window max_draft_tokens + 1 for `target`; max_draft_tokens + num_mtp_layers for `mtp`) — are
padded to (bucket(B), W) and replayed from a graph captured at load; larger calls (prompt prefill)
run eager. Padding is harmless: padded tokens carry position -1, which
writes the pool's scratch position and is never attended (export/mla.py), and padded rows use slot 0.

Graphs of one wrapper share one memory pool for their intermediates (captured largest first): they
never run at once, and outputs are cloned out before the next replay. Each bucket keeps its own static
inputs and outputs, about 4 · b · W · (V + H) bytes per bucket b: for a 129k vocabulary, 64 slots and
W = 5, about 350 MB for the target's buckets together.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
Step = Callable[..., tuple[torch.Tensor, ...]]


class _StaticReplay:
    """A step over static input buffers: `replay()` runs on what `inputs` hold, a call copies into them first."""

    inputs: list[torch.Tensor]

    def replay(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, given in zip(self.inputs, inputs):
            static.copy_(given)
        return self.replay()


class CapturedStep(_StaticReplay):
    """One CUDA graph of `step` over static copies of `example_inputs` (warmed up on a side stream).

    Outputs live in the graph's static buffers: a caller that keeps one past the next replay clones it.
    """

    def __init__(self, step: Step, example_inputs: Sequence[torch.Tensor], warmup: int = 2, pool=None) -> None:
        self.inputs = [x.clone() for x in example_inputs]
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
    """The `CapturedStep` contract without a graph: static inputs, the step run on them (CPU, tests)."""

    def __init__(self, step: Step, example_inputs: Sequence[torch.Tensor], pool=None) -> None:
        self.step = step
        self.inputs = [x.clone() for x in example_inputs]

    def replay(self) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return self.step(*self.inputs)


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below `max_batch`, then `max_batch`."""
    return [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]


class _GraphedStep:
    """Pads fitting calls to a bucket and replays its graph; `key` selects among graph families."""

    def __init__(self, step: Step, max_batch: int, width: int, device: torch.device,
                 keys: Sequence[int | None], hidden: tuple[int, torch.dtype] | None,
                 graph: Callable[..., Step]) -> None:
        self.step, self.width, self.device, self.hidden = step, width, torch.device(device), hidden
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[tuple[int | None, int], Step] = {}
        with self.on_device():
            pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            for key in keys:
                for b in reversed(self.buckets):  # largest first: later captures reuse the pool's blocks
                    self.graphs[key, b] = graph(self._bound(key), self._example(b), pool=pool)

    def on_device(self) -> contextlib.AbstractContextManager:
        """Make `device` the current CUDA device: streams, captures and replays use the current one, which
        is per thread and need not be this model instance's GPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _bound(self, key: int | None) -> Step:
        raise NotImplementedError

    def check_against_eager(self, tolerance: float = 5e-2) -> None:
        """Replay every graph on inputs unlike its capture example and compare its logits with the eager step's.

        Token ids 1 (and random hidden states) rather than the capture's zeros, so a graph that captured
        nothing (it would return the capture-time outputs) fails. Every position is -1: the check writes
        only the scratch position and leaves the KV pool as it found it. RuntimeError with the relative
        error when a graph disagrees.
        """
        generator = torch.Generator(device=self.device).manual_seed(0)
        with self.on_device():
            for (key, b), replay in self.graphs.items():
                inputs = self._example(b)
                inputs[0].fill_(1)
                if self.hidden is not None:
                    inputs[1].normal_(generator=generator)
                with torch.no_grad():
                    expected = self._bound(key)(*inputs)[0].float()  # [b, W, V]
                got = replay(*inputs)[0].float()  # [b, W, V]
                error = float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-6))
                if not error <= tolerance:
                    raise RuntimeError(f"CUDA graph of {'target' if key is None else f'mtp layer {key}'} (batch {b}) "
                                       f"differs from eager: max relative error {error:.2e} > {tolerance:.0e}")

    def _example(self, b: int) -> list[torch.Tensor]:
        """Inputs of bucket b: every token padding (position -1), as a padded call sends them."""
        token_ids = torch.zeros(b, self.width, dtype=torch.long, device=self.device)  # [b, W]
        positions = torch.full((b, self.width), -1, dtype=torch.long, device=self.device)  # [b, W]
        slot_ids = torch.zeros(b, dtype=torch.long, device=self.device)  # [b]
        if self.hidden is None:
            return [token_ids, positions, slot_ids]
        size, dtype = self.hidden
        return [token_ids, torch.zeros(b, self.width, size, dtype=dtype, device=self.device), positions, slot_ids]

    def _fits(self, token_ids: torch.Tensor) -> bool:
        B, T = token_ids.shape
        return 0 < B <= self.buckets[-1] and T <= self.width

    def _replay(self, key: int | None, token_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad to the smallest bucket >= B and width W, replay, and return copies of the real rows."""
        B, T = token_ids.shape
        graph = self.graphs[key, next(size for size in self.buckets if size >= B)]
        static = graph.inputs  # token_ids [b, W], (hidden [b, W, H],) positions [b, W], slot_ids [b]
        static[0].zero_()
        static[0][:B, :T] = token_ids
        static[-2].fill_(-1)
        static[-2][:B, :T] = positions
        static[-1].zero_()
        static[-1][:B] = slot_ids
        if hidden is not None:
            static[1][:B, :T] = hidden  # padded rows keep stale values: their outputs are dropped
        with self.on_device():
            logits, out = graph.replay()  # [b, W, V], [b, W, H]
        return logits[:B, :T].clone(), out[:B, :T].clone()


def target_width(max_draft_tokens: int) -> int:
    """Tokens of `target`'s widest decode call: the verify window [last token, k drafts]."""
    return max_draft_tokens + 1


def mtp_width(max_draft_tokens: int, num_layers: int) -> int:
    """Tokens of `mtp`'s widest decode call: a layer's first drafting call absorbs up to k + 1 accepted
    pairs, then the num_layers - 1 chained drafts before it."""
    return max_draft_tokens + num_layers


class GraphedTarget(_GraphedStep):
    """target(token_ids[B, T], positions[B, T], slot_ids[B]) with graphs for B <= max_batch, T <= width."""

    def __init__(self, step: Step, max_batch: int, width: int, device: torch.device,
                 graph: Callable[..., Step] = CapturedStep) -> None:
        super().__init__(step, max_batch, width, device, [None], None, graph)

    def _bound(self, key: int | None) -> Step:
        return self.step

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor,
                 slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(token_ids):
            return self.step(token_ids, positions, slot_ids)
        return self._replay(None, token_ids, positions, slot_ids)


class GraphedMTP(_GraphedStep):
    """mtp(token_ids, hidden, positions, slot_ids, layer) with graphs per MTP layer for fitting calls."""

    def __init__(self, step: Step, num_layers: int, max_batch: int, width: int, hidden_size: int,
                 hidden_dtype: torch.dtype, device: torch.device, graph: Callable[..., Step] = CapturedStep) -> None:
        super().__init__(step, max_batch, width, device, range(num_layers), (hidden_size, hidden_dtype), graph)
        self.num_layers = num_layers

    def _bound(self, key: int | None) -> Step:
        return lambda token_ids, hidden, positions, slot_ids: self.step(token_ids, hidden, positions, slot_ids, key)

    def __call__(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(token_ids):
            return self.step(token_ids, hidden, positions, slot_ids, layer)
        return self._replay(layer % self.num_layers, token_ids, positions, slot_ids, hidden)


def with_decode_graphs(build: Callable[[], _GraphedStep], step: Step, log: Callable[[str], None]) -> Step:
    """`build()` checked against eager, or `step` itself with a log line saying why graphs are off."""
    try:
        graphed = build()
        graphed.check_against_eager()
    except Exception as exc:  # noqa: BLE001 - eager is always a correct fallback
        log(f"CUDA graphs off, running eager: {type(exc).__name__}: {exc}")
        return step
    log(f"CUDA graphs captured for batch sizes {graphed.buckets} x {graphed.width} tokens")
    return graphed


# Only the eager format's modules capture. A TorchScript step makes a synchronizing CUDA call (found with
# torch.cuda.set_sync_debug_mode("error") on the H200, bench/capture_check.py), which invalidates any
# capture; ONNX Runtime and AOTInductor launch outside torch's capture.
GRAPH_FORMATS = ("eager",)


def graphs_wanted(params: dict[str, str], device: torch.device, world_size: int) -> bool:
    """Whether a `target` / `mtp` model captures decode graphs: config parameter `cuda_graphs` true (the
    export writes it; a repository from before it has none and runs eager) on a CUDA device, the eager
    format, one rank."""
    value = params.get("cuda_graphs", "false")
    if value not in ("true", "false"):
        raise ValueError(f"config.pbtxt: parameter 'cuda_graphs' must be true or false, got {value!r}")
    return value == "true" and device.type == "cuda" and world_size == 1 and params.get("format") in GRAPH_FORMATS
