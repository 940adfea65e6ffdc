"""Requests and results of `spec_decode`, independent of the protocol that carries them.

Vocabulary (as in vLLM): prefill emits the first token; then each decoding step proposes up to `k`
draft tokens, the target accepts a prefix of them and adds one token of its own (a recovered or
bonus token). The acceptance rate is accepted / drafted; the mean accepted length,
1 + accepted / steps, counts the target's token too, so it is the tokens a step emits on average.
The responses do not count steps; every step emits its accepted drafts plus one token, so
steps = output tokens - 1 - accepted (fewer output tokens when a stop word trimmed the text).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import ServerError

# Request tensors of spec_decode: name -> (Triton datatype, numpy dtype).
REQUEST_TENSORS = {
    "text_input": ("BYTES", np.object_),
    "input_ids": ("INT32", np.int32),
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64),
    "num_draft_tokens": ("INT32", np.int32),
    "stop_words": ("BYTES", np.object_),
    "return_logprobs": ("BOOL", np.bool_),
    "stream": ("BOOL", np.bool_),
}
RESPONSE_TENSORS = (
    "text_output",
    "output_ids",
    "logprobs",
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "total_draft_tokens",
    "total_accepted_draft_tokens",
    "accepted_per_position",
)
TOTALS = ("num_input_tokens", "num_output_tokens", "total_draft_tokens", "total_accepted_draft_tokens")


@dataclass(frozen=True)
class GenerateRequest:
    """One completion request; `None` fields are left out so the server's defaults apply."""

    prompt: str | None = None
    input_ids: Sequence[int] | None = None
    max_tokens: int = 64
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_draft_tokens: int | None = None
    stop: Sequence[str] | None = None
    return_logprobs: bool = False
    stream: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if isinstance(self.stop, str) or not all(isinstance(word, str) for word in self.stop or ()):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0 (it is sent as UINT64), got {self.seed}")
        self.arrays()  # every value must fit its tensor's datatype

    def fields(self) -> dict[str, Any]:
        """Request tensor name -> value (a scalar, or a list for input_ids and stop_words)."""
        values = {
            "text_input": self.prompt,
            "input_ids": None if self.input_ids is None else np.asarray(self.input_ids).tolist(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "num_draft_tokens": self.num_draft_tokens,
            "stop_words": list(self.stop) if self.stop else None,
            "return_logprobs": self.return_logprobs or None,
            "stream": self.stream,
        }
        return {name: value for name, value in values.items() if value is not None}

    def arrays(self) -> dict[str, tuple[str, np.ndarray]]:
        """Request tensor name -> (Triton datatype, array) for tensor-based protocols."""
        out = {}
        for name, value in self.fields().items():
            datatype, dtype = REQUEST_TENSORS[name]
            values = value if isinstance(value, list) else [value]
            if dtype is np.object_:
                values = [v.encode() if isinstance(v, str) else v for v in values]
            try:
                array = np.array(values, dtype=dtype)  # [n]
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"{name}: {value!r} cannot be sent as {datatype}") from None
            out[name] = (datatype, array)
        return out


@dataclass(frozen=True)
class Delta:
    """The tokens one streamed response added."""

    text: str
    ids: list[int]
    logprobs: list[float] | None = None


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Acceptance:
    """Speculative-decoding statistics of one request; `accepted_per_position[i]` counts the steps
    whose draft at position i was accepted."""

    draft_tokens: int
    accepted_draft_tokens: int
    accepted_per_position: list[int]
    steps: int

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.accepted_draft_tokens / self.steps if self.draft_tokens and self.steps > 0 else None


@dataclass(frozen=True)
class Completion:
    text: str
    ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    usage: Usage
    acceptance: Acceptance

    def as_dict(self) -> dict[str, Any]:
        """Every response field under its tensor name, plus the derived acceptance figures."""
        return {
            "text_output": self.text,
            "output_ids": self.ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "num_input_tokens": self.usage.input_tokens,
            "num_output_tokens": self.usage.output_tokens,
            "total_draft_tokens": self.acceptance.draft_tokens,
            "total_accepted_draft_tokens": self.acceptance.accepted_draft_tokens,
            "accepted_per_position": self.acceptance.accepted_per_position,
            "acceptance_rate": self.acceptance.acceptance_rate,
            "mean_accepted_length": self.acceptance.mean_accepted_length,
        }


@dataclass
class CompletionBuilder:
    """Joins a request's responses: tokens from every response, totals from the one carrying them."""

    url: str
    deltas: list[Delta] = field(default_factory=list)
    totals: dict[str, Any] | None = None

    def add(self, response: dict[str, Any]) -> Delta:
        """Take one response (tensor name -> value, arrays as lists); return the tokens it added."""
        logprobs = response.get("logprobs")
        delta = Delta(
            text=response.get("text_output", ""),
            ids=[int(i) for i in response.get("output_ids", [])],
            logprobs=None if logprobs is None else [float(p) for p in logprobs],
        )
        self.deltas.append(delta)
        if response.get("finish_reason"):  # earlier responses may carry it empty
            self.totals = response
        return delta

    def build(self) -> Completion:
        if self.totals is None:
            raise ServerError("the server ended the request without sending finish_reason and totals", self.url)
        missing = [name for name in TOTALS if name not in self.totals]
        if missing:
            raise ServerError(f"the final response lacks {', '.join(missing)}", self.url)
        with_logprobs = [d.logprobs for d in self.deltas if d.logprobs is not None]
        output_tokens = int(self.totals["num_output_tokens"])
        accepted = int(self.totals["total_accepted_draft_tokens"])
        return Completion(
            text="".join(d.text for d in self.deltas),
            ids=[i for d in self.deltas for i in d.ids],
            logprobs=[p for lp in with_logprobs for p in lp] if with_logprobs else None,
            finish_reason=self.totals["finish_reason"],
            usage=Usage(int(self.totals["num_input_tokens"]), output_tokens),
            acceptance=Acceptance(
                draft_tokens=int(self.totals["total_draft_tokens"]),
                accepted_draft_tokens=accepted,
                accepted_per_position=[int(n) for n in self.totals.get("accepted_per_position", [])],
                steps=output_tokens - 1 - accepted,
            ),
        )
