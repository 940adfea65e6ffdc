"""What runs inside the `target` and `mtp` Triton models, one call (hop) per engine step.

`TargetWorker.verify` serves every live sequence in one call: rows being prefilled carry their
prompt (no drafts, one token sampled after it), decoding rows carry the window
[last token, draft_1 .. draft_k]. Sampling and rejection run next to the logits, so only ids,
accepted counts, logprobs and the window's hidden states leave the model.

`DraftWorker.propose` first absorbs the newly accepted tokens paired with the target's hidden
states into every MTP layer's cache (prefill: the shifted prompt), then drafts up to k tokens per
row autoregressively: draft step s uses MTP layer `s % num_layers` and recycles the MTP's own
hidden state after `shared_head.norm` (DeepSeek-V3 §2.2, as served by vLLM / SGLang). A layer
absorbs in its first drafting call, and only layers the rows still draft with absorb, so a step
makes k MTP calls rather than num_layers + k - 1.

The hop payloads are dataclasses of tensors whose field names are the Triton tensor names, so the
`model.py` adapters and the in-process test backend move them the same way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from triton_mtp.serving.rejection import verify as verify_drafts
from triton_mtp.serving.rejection import verify_greedy
from triton_mtp.serving.sampling import GREEDY_TEMPERATURE, SamplingParams, row_generator, sample, target_probs
from triton_mtp.serving.transfers import PendingHost, to_device

TargetStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
MTPStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
# (token_ids, positions, slot_ids, num_draft, K, greedy) -> (window_logits, draft_ids, num_accepted, output_ids,
# logprobs, hidden); the greedy verification's three are None when `greedy` is false
WindowStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool], tuple[torch.Tensor, ...]]
# (token_ids, hidden, positions, slot_ids, num_draft, K) -> draft_ids [B, K]
ChainStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def emitted_logprobs(window_logits: torch.Tensor, output_ids: torch.Tensor) -> torch.Tensor:
    """[B, K+1] log p(output token) under the unprocessed target; 0 past the emitted tokens (id -1)."""
    logprobs = window_logits.log_softmax(-1).gather(-1, output_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(output_ids >= 0, logprobs, 0.0)


def verify_window(target: TargetStep) -> WindowStep:
    """The target call and everything after it that needs no draws, as one function of tensors
    (the decode graphs capture it whole):

    window(token_ids [B, T], positions [B, T], slot_ids [B], num_draft [B], K, greedy=True) returns
    window_logits [B, K+1, V] (each row's logits from the token before its drafts on), draft_ids [B, K],
    greedy verification's num_accepted [B] and output_ids [B, K+1] with their logprobs [B, K+1], the
    three again as one tensor for the host (`window_results`; all four None when `greedy` is false: a
    sampled batch verifies by rejection sampling), and hidden [B, T, H] float32. Columns past a row's own
    num_draft are padding: a wider K changes none of the rest.
    """

    def window(token_ids, positions, slot_ids, num_draft, K, greedy=True):
        logits, hidden = target(token_ids, positions, slot_ids)  # [B, T, V], [B, T, H]
        B, T, V = logits.shape
        length = (positions >= 0).sum(1)  # [B] valid tokens per row
        first = length - 1 - num_draft  # [B] index of the token before the drafts
        index = (first.view(B, 1) + torch.arange(K + 1, device=logits.device)).clamp(0, T - 1)  # [B, K+1]
        window_logits = logits.gather(1, index.unsqueeze(-1).expand(B, K + 1, V))  # [B, K+1, V]
        draft_ids = token_ids.gather(1, index[:, 1:])  # [B, K]
        if not greedy:
            return window_logits, draft_ids, None, None, None, hidden.float(), None
        num_accepted, output_ids = verify_greedy(window_logits.argmax(-1), draft_ids, num_draft)  # [B], [B, K+1]
        logprobs = emitted_logprobs(window_logits, output_ids)  # [B, K+1]
        return (window_logits, draft_ids, num_accepted, output_ids, logprobs, hidden.float(),
                window_results(output_ids, num_accepted, logprobs))

    return window


def multi_step(window: WindowStep, steps: int) -> WindowStep:
    """`steps` greedy one-token target calls in a row as one window step (vLLM's multi-step scheduling: graphed,
    the host's work of a call is paid once per `steps` tokens of every row):

    run(token_ids [B, 1], positions [B, 1], slot_ids [B], num_draft [B] (zeros), K=0, greedy=True) feeds each
    call's argmax to the next, at the next position (padding, -1, stays padding), and returns window_logits None
    (no row samples), draft_ids [B, 0], num_accepted [B] = steps - 1 (every token but the last counts as accepted:
    the host takes all of them), output_ids and logprobs [B, steps], hidden [B, steps, H] float32 and their
    `window_results`. A row's tokens past EOS or max_tokens are the host's to cut.
    """

    def run(token_ids, positions, slot_ids, num_draft, K=0, greedy=True):
        ids, logprobs, hidden = [], [], []
        for _ in range(steps):
            _, draft_ids, _, output_ids, step_logprobs, step_hidden, _ = window(
                token_ids, positions, slot_ids, num_draft, 0, True)  # [B, 0], [B, 1] x2, [B, 1, H]
            ids.append(output_ids.clone())  # a graph's buffer, which the next call overwrites
            logprobs.append(step_logprobs.clone())
            hidden.append(step_hidden.clone())
            token_ids, positions = ids[-1], torch.where(positions >= 0, positions + 1, -1)  # [B, 1] x2
        output_ids, logprobs = torch.cat(ids, 1), torch.cat(logprobs, 1)  # [B, steps] x2
        num_accepted = torch.full_like(output_ids[:, 0], steps - 1)  # [B]
        return (None, draft_ids, num_accepted, output_ids, logprobs, torch.cat(hidden, 1),
                window_results(output_ids, num_accepted, logprobs))

    return run


def window_results(output_ids: torch.Tensor, num_accepted: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[B, 2W+1] float64: output_ids [B, W], num_accepted [B] and logprobs [B, W] side by side (ids are exact in
    float64), so that a greedy verify's results leave the device as one contiguous tensor, with one copy,
    and come apart on the host without a torch call each (`PendingTarget`)."""
    return torch.cat([output_ids.double(), num_accepted.double().unsqueeze(1), logprobs.double()], 1)


def split_window_results(columns: np.ndarray, K1: int, drafts: int | None = None) -> dict[str, np.ndarray]:
    """`window_results` [B, 2W+1] (W >= K1 = K+1; then `drafts` draft-id columns, when given) on the host, back
    to a TargetResult's output_ids [B, K+1], num_accepted [B] and logprobs [B, K+1] (and draft_ids [B, K']),
    as numpy arrays."""
    W = (columns.shape[1] - 1 - (drafts or 0)) // 2
    fields = {"output_ids": columns[:, :K1].astype(np.int64), "num_accepted": columns[:, W].astype(np.int64),
              "logprobs": columns[:, W + 1: W + 1 + K1].astype(np.float32)}
    if drafts is not None:
        fields["draft_ids"] = columns[:, 2 * W + 1:].astype(np.int64)
    return fields


def draft_chain(mtp: MTPStep, num_layers: int, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slot_ids: torch.Tensor, num_draft: torch.Tensor, K: int,
                pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """draft_ids [B, K] (0 past num_draft[b]): absorb the pairs (token_ids [B, T], hidden [B, T, H] in the
    MTP's dtype, positions [B, T], -1 = padding) into the MTP caches, then draft K tokens per row.

    `pick(step, logits [B, V]) -> token [B]` chooses each draft; None is argmax, which keeps the whole
    chain a function of tensors (the decode graphs capture it). A row of padding only (no valid
    position, num_draft 0) writes nothing but the scratch position.
    """
    B = slot_ids.shape[0]
    last = ((positions >= 0).sum(1) - 1).clamp(min=0)  # [B] index of the last absorbed pair
    base = positions.gather(1, last.view(B, 1))  # [B, 1] its position; -1 for a row of padding
    # Every layer a row drafts with must cover every position up to `base`. Layer 0 absorbs now and its
    # last row drafts token 1. Layer l >= 1 first drafts at chain step l and absorbs in that same call
    # (the absorbed pairs, then its chain pairs). A layer l >= K is skipped: a row's draft count never
    # grows, so no row of this batch drafts with it again. One MTP call per draft token.
    deferred = set(range(1, min(num_layers, K)))
    logits, out = mtp(token_ids, hidden, positions, slot_ids, 0)  # [B, T, V], [B, T, H]
    rows = torch.arange(B, device=slot_ids.device)  # [B]
    logits, out = logits[rows, last], out[rows, last]  # [B, V], [B, H] from layer 0: draft 1

    drafts = []
    chain_tokens, chain_hidden = [], []  # pairs for positions base+1, base+2, ...
    written = [0] * num_layers  # per layer: chain pairs already in its cache
    for step in range(K):
        token = logits.argmax(-1) if pick is None else pick(step, logits)  # [B]
        drafts.append(token)
        if step + 1 == K:
            break
        chain_tokens.append(token)
        chain_hidden.append(out)
        layer = (step + 1) % num_layers
        # Write the chain pairs this layer has not seen yet, up to position base + step + 1.
        start = written[layer]
        tokens = torch.stack(chain_tokens[start:], 1)  # [B, n]
        pairs_hidden = torch.stack(chain_hidden[start:], 1)  # [B, n, H]
        offsets = torch.arange(start + 1, step + 2, device=base.device)  # [n]
        drafting = (num_draft.view(B, 1) > step + 1) & (base >= 0)  # [B, 1] done rows and padding write nothing
        chain_positions = torch.where(drafting, base + offsets, -1)  # [B, n]
        if layer in deferred:  # the absorbed pairs first; padding between them writes only scratch
            deferred.discard(layer)
            tokens = torch.cat([token_ids, tokens], 1)  # [B, T + n]
            pairs_hidden = torch.cat([hidden, pairs_hidden], 1)  # [B, T + n, H]
            chain_positions = torch.cat([positions, chain_positions], 1)  # [B, T + n]
        logits, out = mtp(tokens, pairs_hidden, chain_positions, slot_ids, layer)  # [B, n, V], [B, n, H]
        logits, out = logits[:, -1], out[:, -1]  # [B, V], [B, H]
        written[layer] = step + 1
    draft_ids = torch.stack(drafts, 1)  # [B, K]
    keep = torch.arange(K, device=draft_ids.device) < num_draft.view(B, 1)  # [B, K]
    return torch.where(keep, draft_ids, 0)


def _run_positions(start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width]: positions start [B, 1] + 0, 1, ... for count [B] + 1 tokens per row, then -1; all -1 where
    start is negative (a row of padding in a graph's bucket, whose positions are -1)."""
    offsets = torch.arange(width, device=start.device)  # [width]
    return torch.where((offsets <= count.view(-1, 1)) & (start >= 0), start + offsets, -1)


def accepted_pairs(output_ids: torch.Tensor, num_accepted: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MTP pairs (t_{i+1}, h_i) a verified decode window leaves, where they are: token_ids [B, K+1] (the
    emitted tokens output_ids [B, K+1]), hidden [B, K+1, H] (the window's hidden [B, K+1, H]) and positions
    [B, K+1] (i from the window's first position, -1 past the row's num_accepted [B] + 1 emitted tokens)."""
    W = output_ids.shape[1]
    return output_ids.clamp(min=0), hidden[:, :W], _run_positions(positions[:, :1], num_accepted, W)  # [B, K+1]


def next_window(output_ids: torch.Tensor, num_accepted: torch.Tensor, positions: torch.Tensor,
                draft_ids: torch.Tensor, num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify window after a decode window, where it is: token_ids [B, K'+1] (the last emitted token of
    output_ids [B, K+1], then draft_ids [B, K']) at positions [B, K'+1] (after the num_accepted [B] + 1
    emitted tokens; -1 past num_draft [B] drafts), as the scheduler builds it on the host."""
    B, K = draft_ids.shape
    last = output_ids.gather(1, num_accepted.view(B, 1))  # [B, 1]
    start = positions[:, :1] + num_accepted.view(B, 1) + 1  # [B, 1]
    return torch.cat([last, draft_ids], 1), _run_positions(start, num_draft, K + 1)  # [B, K'+1] x2


ChainedDraft = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def chained_draft(greedy: ChainStep, dtype: torch.dtype) -> Callable[..., ChainedDraft]:
    """What a chained call does after the greedy verify, as one function of tensors (the decode graphs
    capture it whole, `graphs.GraphedChain`): after(output_ids [B, W], num_accepted [B], hidden [B, W, H],
    positions [B, W], slot_ids [B], num_draft [B], results [B, 2W+1], K) absorbs the pairs the verify
    accepted (`accepted_pairs`) and drafts num_draft (at most K) tokens per row by argmax with `greedy`
    (`draft_chain`'s arguments), and returns draft_ids [B, K], the next window (`next_window`: its token ids
    and positions [B, K+1]) and the verify's `window_results` with the drafts after them [B, 2W+1+K]."""

    def after(output_ids, num_accepted, hidden, positions, slot_ids, num_draft, results, K):
        pair_ids, pair_hidden, pair_positions = accepted_pairs(output_ids, num_accepted, hidden, positions)
        draft_ids = greedy(pair_ids, pair_hidden.to(dtype), pair_positions, slot_ids, num_draft, K)  # [B, K]
        next_ids, next_positions = next_window(output_ids, num_accepted, positions, draft_ids, num_draft)
        return draft_ids, next_ids, next_positions, torch.cat([results, draft_ids.double()], 1)

    return after


class _Payload:
    """Tensor fields <-> numpy arrays named by field; an absent optional field is None."""

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]):
        values = {}
        for f in dataclasses.fields(cls):
            array = arrays.get(f.name)
            if array is None:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"{f.name}: missing input tensor")
                values[f.name] = None
            else:
                values[f.name] = torch.from_numpy(np.ascontiguousarray(array))
        return cls(**values)

    def to(self, device: torch.device | str, fields: Sequence[str] | None = None):
        """The same payload with every tensor (of `fields`, default all) on `device`, moved with one transfer per
        source device."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" names the current device
            device = torch.device("cuda", torch.cuda.current_device())
        names = [name for name in fields or [f.name for f in dataclasses.fields(self)] if getattr(self, name) is not None]
        return dataclasses.replace(self, **dict(zip(names, to_device([getattr(self, name) for name in names], device))))

    def to_arrays(self) -> dict[str, np.ndarray]:
        host = self.to("cpu")
        return {f.name: getattr(host, f.name).detach().numpy() for f in dataclasses.fields(host)
                if getattr(host, f.name) is not None}


@dataclass
class RowParams(_Payload):
    """Per-row sampling knobs and seeds shared by both hops' inputs."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64 (the request's uint64 seed, bit for bit)
    new: torch.Tensor  # [B] bool: first call for this slot's sequence, (re)seed its generator

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def all_greedy(self) -> bool:
        """Whether every row decodes greedily (read on the host copy, through numpy: no torch call per step)."""
        return bool((self.temperature.numpy() < GREEDY_TEMPERATURE).all())


@dataclass
class TargetBatch(RowParams):
    token_ids: torch.Tensor = None  # [B, T] int64: prompt, or [last, drafts...]
    positions: torch.Tensor = None  # [B, T] int64, -1 = padding
    slot_ids: torch.Tensor = None  # [B] int64
    num_draft: torch.Tensor = None  # [B] int64: the last num_draft[b] valid tokens are drafts
    draft_top_ids: torch.Tensor | None = None  # [B, K, N] support of q for sampled drafts; None: argmax drafts
    draft_top_probs: torch.Tensor | None = None  # [B, K, N] q on that support

    def draft_probs(self, vocab_size: int) -> torch.Tensor | None:
        """[B, K, V] dense q, zero outside the support the drafts were sampled from."""
        if self.draft_top_ids is None:
            return None
        B, K, _ = self.draft_top_ids.shape
        dense = torch.zeros(B, K, vocab_size, dtype=torch.float32, device=self.draft_top_ids.device)  # [B, K, V]
        return dense.scatter_(2, self.draft_top_ids, self.draft_top_probs.float())


@dataclass
class TargetResult(_Payload):
    output_ids: torch.Tensor  # [B, K+1] int64: accepted drafts, then the recovered/bonus token, then -1
    num_accepted: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B, K+1] float32: log p(output token) under the unprocessed target
    hidden: torch.Tensor | None = None  # [B, T, H] float32: target hidden after model.norm, per window position
    draft_ids: torch.Tensor | None = None  # [B, K'] the next window's drafts, where a chained call drafted them


@dataclass
class DraftBatch(RowParams):
    token_ids: torch.Tensor = None  # [B, T] int64: tokens t_{i+1} to absorb
    hidden: torch.Tensor = None  # [B, T, H] float32: target hidden h_i paired with them
    positions: torch.Tensor = None  # [B, T] int64: i, -1 = padding
    slot_ids: torch.Tensor = None  # [B] int64
    num_draft: torch.Tensor = None  # [B] int64: drafts wanted per row (>= 1)


@dataclass
class DraftResult(_Payload):
    draft_ids: torch.Tensor  # [B, K] int64, 0 past num_draft[b]
    draft_top_ids: torch.Tensor | None = None  # [B, K, N] when any row samples: q's support ...
    draft_top_probs: torch.Tensor | None = None  # [B, K, N] ... and q on it (float32)


# Sampled drafts come from the MTP distribution truncated to its DRAFT_SUPPORT most likely tokens;
# only that support crosses the hop. Verification stays exact: it uses the q drafts were drawn from.
DRAFT_SUPPORT = 64
DRAFT_SEED_SALT = 0x9E37_79B9_7F4A_7C15  # the drafter's stream must not replay the target's draws


class _Generators:
    """One torch.Generator per slot, reseeded (request seed ^ salt) when a slot starts a new sequence."""

    def __init__(self, max_slots: int, device: torch.device, salt: int = 0) -> None:
        self._device = device
        self._salt = salt
        self._by_slot: list[torch.Generator | None] = [None] * max_slots

    def rows(self, slot_ids: torch.Tensor, seeds: torch.Tensor, new: torch.Tensor) -> list[torch.Generator]:
        for slot, seed, fresh in zip(slot_ids.tolist(), seeds.tolist(), new.tolist()):
            if fresh or self._by_slot[slot] is None:
                self._by_slot[slot] = row_generator((seed & 0xFFFF_FFFF_FFFF_FFFF) ^ self._salt, self._device)
        return [self._by_slot[slot] for slot in slot_ids.tolist()]


def _check_slots(slot_ids: torch.Tensor, max_slots: int) -> None:
    bad = [slot for slot in slot_ids.tolist() if not 0 <= slot < max_slots]  # a host list: no tensor ops per step
    if bad:
        raise ValueError(f"slot_ids: slot {bad[0]} outside the pool [0, {max_slots})")


_WINDOW_INPUTS = ("token_ids", "positions", "slot_ids", "num_draft")  # what a greedy target call reads on the device


class TargetWorker:
    """Verifies drafts (and prefills prompts) for all rows with one target call.

    `window` is `verify_window(target)` or the decode graphs of it (serving/graphs.py), whose `place` puts
    a call's inputs where its graph reads them. With `decode_steps` N > 1, a call of greedy one-token rows may
    run N target steps (`launch(batch, steps=N)`) through `steps`: by default `multi_step(window, N)`, or
    the graphs of it (`graphs.GraphedSteps`).
    """

    def __init__(self, window: WindowStep, max_slots: int, device: torch.device | str = "cpu", decode_steps: int = 1,
                 steps: WindowStep | None = None) -> None:
        if decode_steps < 1:
            raise ValueError(f"decode_steps: must be >= 1, got {decode_steps}")
        self.window = window
        self.decode_steps = decode_steps
        self._windows = {1: window}
        if decode_steps > 1:
            self._windows[decode_steps] = steps or multi_step(window, decode_steps)
        self._places = {n: getattr(w, "place", self._moved) for n, w in self._windows.items()}
        self._max_slots = max_slots
        self._device = torch.device(device)
        self._generators = _Generators(max_slots, self._device)

    def _moved(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """A window step's inputs on the device, for a step without graphs to `place` them."""
        return to_device(list(inputs), self._device)

    @torch.no_grad()
    def verify(self, batch: TargetBatch) -> TargetResult:
        """The result's tensors may be the decode graph's buffers: read them before the next call."""
        return self.launch(batch)[0]

    @torch.no_grad()
    def launch(self, batch: TargetBatch, steps: int = 1) -> tuple[TargetResult, TargetBatch, torch.Tensor | None]:
        """`verify`, also returning the batch with its tensors on the device (for work chained on) and, for a
        greedy batch, the result again as one tensor (`window_results`), which leaves the device in one copy.
        `steps` = `decode_steps` (greedy one-token rows only) runs that many target steps: output_ids [B, steps]."""
        # Decisions on the host copies, before the batch moves: no device sync for them.
        _check_slots(batch.slot_ids, self._max_slots)
        all_greedy = batch.all_greedy()
        generators = None if all_greedy else self._generators.rows(batch.slot_ids, batch.seeds, batch.new)
        num_draft = batch.num_draft.numpy()  # [B]
        K = int(num_draft.max()) if num_draft.size else 0
        if steps != 1 and (steps not in self._windows or not all_greedy or K or batch.token_ids.shape[1] != 1):
            raise ValueError(f"decode_steps: a call runs 1 step, or {self.decode_steps} over greedy one-token rows "
                             f"without drafts; got {steps} over {batch.token_ids.shape[1]}-token rows")
        draft_lengths = [] if all_greedy else np.unique(num_draft).tolist()  # k values of the per-k verify
        inputs = self._places[steps](*(getattr(batch, name) for name in _WINDOW_INPUTS))
        batch = dataclasses.replace(batch, **dict(zip(_WINDOW_INPUTS, inputs)))
        if not all_greedy:  # the sampling knobs and q too; greedy, they stay
            batch = batch.to(self._device)
        window_logits, draft_ids, num_accepted, output_ids, logprobs, hidden, results = self._windows[steps](
            *inputs, K, all_greedy)  # [B, K+1, V], ..., [B, T, H], [B, 2(K+1)+1]
        if not all_greedy:
            num_accepted, output_ids = self._verify_sampled(batch, window_logits, draft_ids, draft_lengths, generators)
            logprobs = emitted_logprobs(window_logits, output_ids)  # [B, K+1]
            results = None  # a replay's are its greedy verification's
        return TargetResult(output_ids, num_accepted, logprobs, hidden), batch, results

    @staticmethod
    def _verify_sampled(batch: TargetBatch, window_logits: torch.Tensor, draft_ids: torch.Tensor,
                        draft_lengths: list[int], generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling; one verify per draft length k, so a row's draws depend on its own k only."""
        B, K1, V = window_logits.shape
        params = batch.sampling()
        probs = target_probs(window_logits, params)  # [B, K+1, V]
        draft_probs = batch.draft_probs(V)  # [B, K, V] or None
        num_accepted = torch.zeros(B, dtype=torch.int64, device=window_logits.device)  # [B]
        output_ids = torch.full((B, K1), -1, dtype=torch.int64, device=window_logits.device)  # [B, K+1]
        for k in draft_lengths:
            rows = (batch.num_draft == k).nonzero().squeeze(1)  # [b]
            q = None if draft_probs is None else draft_probs[rows, :k]  # [b, k, V]
            accepted, emitted = verify_drafts(
                probs[rows, : k + 1], draft_ids[rows, :k], q, batch.num_draft[rows],
                params.greedy[rows], [generators[i] for i in rows.tolist()],
            )  # [b], [b, k+1]
            num_accepted[rows] = accepted
            output_ids[rows, : k + 1] = emitted
        return num_accepted, output_ids


class DraftWorker:
    """Absorbs accepted tokens into the MTP caches and drafts up to k tokens per row, in one call.

    Argmax drafting runs `greedy` (the decode graphs of `draft_chain`; by default the chain over `mtp`);
    sampled drafting runs the chain over `mtp` with its draws between the calls.
    """

    def __init__(self, mtp: MTPStep, num_layers: int, max_slots: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, greedy: ChainStep | None = None) -> None:
        if num_layers < 1:
            raise ValueError(f"num_mtp_layers: must be >= 1 to draft, got {num_layers}")
        self.mtp = mtp
        self._num_layers = num_layers
        self._greedy = greedy or (lambda *inputs: draft_chain(mtp, num_layers, *inputs))
        self._after = chained_draft(self._greedy, dtype)
        self._max_slots = max_slots
        self._device = torch.device(device)
        self._dtype = dtype
        self._generators = _Generators(max_slots, self._device, DRAFT_SEED_SALT)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> DraftResult:
        """The result's tensors may be the decode graph's buffers: read them before the next call."""
        # Decisions on the host copies, before the batch moves: no device sync for them.
        _check_slots(batch.slot_ids, self._max_slots)
        sampled = not batch.all_greedy()
        wanted = batch.num_draft.tolist()  # [B] drafts per row
        K = max(wanted)
        generators = self._generators.rows(batch.slot_ids, batch.seeds, batch.new) if sampled else None
        batch = batch.to(self._device)
        hidden = batch.hidden.to(self._dtype)  # [B, T, H]
        inputs = (batch.token_ids, hidden, batch.positions, batch.slot_ids, batch.num_draft)
        if not sampled:
            return DraftResult(self._greedy(*inputs, K))
        params = batch.sampling()
        top_ids, top_probs = [], []

        def pick(step: int, logits: torch.Tensor) -> torch.Tensor:  # logits [B, V] -> token [B]
            probs = target_probs(logits.unsqueeze(1), params)[:, 0]  # [B, V]
            token = probs.argmax(-1)  # [B] greedy rows draft the processed distribution's argmax
            q, support = probs.topk(min(DRAFT_SUPPORT, probs.shape[-1]), dim=-1)  # [B, N], [B, N]
            q = q / q.sum(-1, keepdim=True)  # [B, N]
            top_ids.append(support)
            top_probs.append(q)
            # Draw only for rows still drafting, so a row's draws depend on its own k.
            active = [b for b in range(len(wanted)) if wanted[b] > step]
            dense = torch.zeros_like(probs).scatter_(-1, support, q)  # [B, V]
            active_rows = torch.tensor(active, device=dense.device)  # [b]
            token[active_rows] = sample(dense[active_rows].unsqueeze(1), [generators[b] for b in active])[:, 0]
            return token

        draft_ids = draft_chain(self.mtp, self._num_layers, *inputs, K, pick)  # [B, K]
        return DraftResult(draft_ids, torch.stack(top_ids, 1), torch.stack(top_probs, 1).float())  # [B, K, N] x2

    @torch.no_grad()
    def draft_after(self, result: TargetResult, verified: TargetBatch, results: torch.Tensor, K: int) -> ChainedDraft:
        """`chained_draft` over the greedy chain, from a greedy verify's result on the device without the host:
        `verified` is the verified batch on the device, `results` the result's `window_results`."""
        return self._after(result.output_ids, result.num_accepted, result.hidden, verified.positions,
                           verified.slot_ids, verified.num_draft, results, K)


@dataclass
class HostResult:
    """A target call's result as the engine reads it: Python lists, and the hidden states on the host."""

    num_accepted: list[int]  # [B]
    output_ids: list[list[int]]  # [B][K+1]: accepted drafts, then the recovered/bonus token, then -1
    logprobs: list[list[float]]  # [B][K+1]
    hidden: torch.Tensor | None  # [B, T, H] float32, where asked for
    draft_ids: list[list[int]] | None  # [B][K']: the next window's drafts, where a chained call drafted them


class PendingTarget:
    """A target call's result on its way to the host (`TargetWorker.verify` launches the call; this copies its
    result out with one transfer, asynchronous from a GPU: `transfers.PendingHost`).

    `read()` waits for this call alone, on a CUDA event rather than the stream, so a call launched after
    it keeps the device busy while the host reads this one. `next_ids` [B, 1] are, for a call without drafts, the
    last token each row emits (its only one, or a multi-step call's last), where it made them: a call launched
    before `read()` takes them as input without a round trip. They may be a decode graph's buffer, valid until the
    next target call. `hidden=False` leaves the hidden states on the device (None in the result) when no row pends
    MTP pairs. A chained call (`window`: the next verify window it drafted, `next_window`) offers that window
    instead: `next_ids` [B, K'+1] at `next_positions` [B, K'+1], on the device. `results` (a greedy call's
    `window_results` [B, 2W+1], then the result's draft_ids [B, K'] where it has them) carries the ids, counts and
    logprobs instead of their own tensors.
    """

    def __init__(self, result: TargetResult, hidden: bool = True,
                 window: tuple[torch.Tensor, torch.Tensor] | None = None, results: torch.Tensor | None = None) -> None:
        ids = result.output_ids  # [B, K+1] or [B, steps]: a one-step call without drafts emits [B, 1], no slice
        self.next_ids, self.next_positions = window or (ids if ids.shape[1] == 1 else ids[:, -1:], None)  # [B, 1] or [B, K'+1] x2
        self._width = result.output_ids.shape[1]  # K+1
        self._drafts = None if result.draft_ids is None else result.draft_ids.shape[1]  # K'
        fields = {"output_ids": result.output_ids, "num_accepted": result.num_accepted, "logprobs": result.logprobs,
                  "draft_ids": result.draft_ids}
        if results is not None:
            fields = {"results": results}
        fields["hidden"] = result.hidden if hidden else None
        self._names = [name for name, t in fields.items() if t is not None]
        self._pending = PendingHost([fields[name] for name in self._names])

    def read(self) -> HostResult:
        """The result on the host, once the call and its copy are done: lists read through numpy (no torch call
        each, transfers.py) and the hidden states as a tensor of their own (not the graph's or the ring's)."""
        host = dict(zip(self._names, self._pending.arrays()))
        results = host.pop("results", None)
        if results is not None:  # [B, 2W+1 (+K')]
            host.update(split_window_results(results, self._width, self._drafts))
        hidden, draft_ids = host.get("hidden"), host.get("draft_ids")
        return HostResult(host["num_accepted"].tolist(), host["output_ids"].tolist(), host["logprobs"].tolist(),
                          hidden if hidden is None or isinstance(hidden, torch.Tensor) else torch.from_numpy(hidden),
                          None if draft_ids is None else draft_ids.tolist())


class InProcessHops:
    """The scheduler's hops served by workers in this process (no server, same code path). Target calls
    return before the device finishes them (`overlaps`), so the engine can launch the next one first, and
    a greedy verify can draft the next window on the device before the host reads it (`chains`).

    `chained` (`graphs.GraphedChain`, over the target worker's decode graphs): what a chained call does after
    the verify, replayed as one graph that reads the verify graph's buffers where they are."""

    overlaps = chains = True

    def __init__(self, target: TargetWorker, draft: DraftWorker | None, chained=None) -> None:
        self._target, self._draft, self._chained = target, draft, chained
        self.decode_steps = target.decode_steps

    def launch_target(self, batch: TargetBatch, hidden: bool = True, steps: int = 1) -> PendingTarget:
        """`steps` > 1 (`decode_steps`): that many target steps over greedy one-token rows."""
        result, _, results = self._target.launch(batch, steps)
        return PendingTarget(result, hidden, results=results)

    def launch_chained(self, batch: TargetBatch) -> PendingTarget:
        """Verify `batch` (greedy rows that all drafted, pairs absorbed), then, on the device, absorb the pairs
        it accepts into the MTP caches and draft as many tokens per row again (batch.num_draft) for the next
        window, offered as the pending call's `next_ids` / `next_positions`; the drafts also come back as
        `draft_ids`."""
        if self._draft is None:
            raise RuntimeError("mtp: the checkpoint has no MTP layers")
        K = int(batch.num_draft.numpy().max())  # on the host copy
        result, verified, results = self._target.launch(batch)
        if self._chained is not None and self._chained.covers(batch.token_ids, K):
            draft_ids, *window, results = self._chained(batch.token_ids.shape[0], K)  # [B, K], [B, K+1] x2, ...
        else:
            draft_ids, *window, results = self._draft.draft_after(result, verified, results, K)
        return PendingTarget(dataclasses.replace(result, draft_ids=draft_ids), hidden=False, window=tuple(window),
                             results=results)  # results [B, 2W+1+K]

    def mtp(self, batch: DraftBatch) -> DraftResult:
        if self._draft is None:
            raise RuntimeError("mtp: the checkpoint has no MTP layers")
        return self._draft.propose(batch).to("cpu")
