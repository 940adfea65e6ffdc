"""What a `spec_decode` request asks for and what it gets back, validated field by field.

The tensor names follow DESIGN.md's public interface (and the Triton TensorRT-LLM BLS conventions
where they overlap). Parsing works on plain numpy arrays so it is testable without a server; every
bad field raises `RequestError` whose message starts with the field's name.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class RequestError(ValueError):
    """A request field is missing, malformed or out of range (-> INVALID_ARG)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.field = name


class QueueFull(RuntimeError):
    """All slots are busy and the waiting queue is at its bound (-> UNAVAILABLE)."""


class TextStream(Protocol):
    """Incremental detokenization of one sequence: a few tokens of context per call, not the whole text."""

    def step(self, token_id: int) -> str: ...  # the text this token completes ("" inside a character)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def decode_stream(self) -> TextStream: ...


@dataclass(frozen=True)
class EngineLimits:
    """Sizes fixed by the export; requests are checked against them."""

    max_slots: int
    max_seq_len: int
    vocab_size: int
    max_draft_tokens: int
    default_num_draft_tokens: int
    eos_token_id: int  # -1: the model has none
    max_queue_size: int
    max_prompt_bytes: int  # text_input is refused before tokenizing beyond this
    max_prompt_tokens: int
    max_output_tokens: int  # cap on max_tokens
    request_timeout_s: float  # queue + generation; 0 = no limit


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    num_draft_tokens: int = 0  # 0: plain decoding
    stop_words: list[str] = field(default_factory=list)
    return_logprobs: bool = False
    stream: bool = False


@dataclass
class GenerationResponse:
    """One response: the new tokens (of a step when streaming) and the running totals."""

    text_output: str
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "" while streaming, then "length" | "stop" | "cancelled"
    num_input_tokens: int
    num_output_tokens: int
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    accepted_per_position: list[int]

    def to_arrays(self, final: bool = True) -> dict[str, np.ndarray]:
        """The response tensors. A streamed, non-final response carries the step's tokens only (text,
        ids, logprobs): every tensor is a shared-memory allocation in the Python backend, and the
        finish reason and totals come with the final response."""
        arrays = {
            "text_output": np.array([self.text_output.encode("utf-8")], dtype=np.object_),
            "output_ids": np.array(self.output_ids, dtype=np.int32),
        }
        if self.logprobs is not None:
            arrays["logprobs"] = np.array(self.logprobs, dtype=np.float32)
        if final:
            arrays.update({
                "finish_reason": np.array([self.finish_reason.encode("utf-8")], dtype=np.object_),
                "num_input_tokens": np.array([self.num_input_tokens], dtype=np.int32),
                "num_output_tokens": np.array([self.num_output_tokens], dtype=np.int32),
                "total_draft_tokens": np.array([self.total_draft_tokens], dtype=np.int32),
                "total_accepted_draft_tokens": np.array([self.total_accepted_draft_tokens], dtype=np.int32),
                "accepted_per_position": np.array(self.accepted_per_position, dtype=np.int32),
            })
        return arrays


def _one(inputs: Mapping[str, np.ndarray], name: str, kinds: str, what: str):
    """The single value of an optional scalar tensor, or None when absent."""
    if name not in inputs:
        return None
    value = np.asarray(inputs[name])
    if value.size != 1:
        raise RequestError(name, f"expected one {what} value, got shape {list(value.shape)}")
    if value.dtype.kind not in kinds:
        raise RequestError(name, f"expected {what}, got dtype {value.dtype}")
    return value.reshape(-1)[0]


def _text(raw, name: str) -> str:
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(name, "not valid UTF-8") from None
    if isinstance(raw, str):
        return raw
    raise RequestError(name, f"expected BYTES, got {type(raw).__name__}")


def _prompt(inputs: Mapping[str, np.ndarray], limits: EngineLimits, tokenizer: Tokenizer | None) -> list[int]:
    has_text, has_ids = "text_input" in inputs, "input_ids" in inputs
    if has_text == has_ids:
        raise RequestError("text_input", "give exactly one of text_input or input_ids")
    if has_text:
        if tokenizer is None:
            raise RequestError("text_input", "the repository has no tokenizer.json; send input_ids")
        raw = _one(inputs, "text_input", "OSU", "BYTES")
        size = len(raw) if isinstance(raw, bytes) else len(str(raw).encode("utf-8"))
        if size > limits.max_prompt_bytes:
            raise RequestError("text_input", f"{size} bytes exceeds max_prompt_bytes {limits.max_prompt_bytes}")
        ids = list(tokenizer.encode(_text(raw, "text_input")))
        if not ids:
            raise RequestError("text_input", "empty prompt")
        return _check_prompt_tokens(ids, "text_input", limits)
    raw = np.asarray(inputs["input_ids"])
    if raw.dtype.kind not in "iu":
        raise RequestError("input_ids", f"expected INT32, got dtype {raw.dtype}")
    if raw.ndim != 1 and not (raw.ndim == 2 and raw.shape[0] == 1):
        raise RequestError("input_ids", f"expected shape [n], got {list(raw.shape)}")
    ids = raw.reshape(-1).astype(np.int64)
    if ids.size == 0:
        raise RequestError("input_ids", "empty prompt")
    bad = ids[(ids < 0) | (ids >= limits.vocab_size)]
    if bad.size:
        raise RequestError("input_ids", f"token id {int(bad[0])} outside the vocabulary [0, {limits.vocab_size})")
    return _check_prompt_tokens(ids.tolist(), "input_ids", limits)


def _check_prompt_tokens(ids: list[int], name: str, limits: EngineLimits) -> list[int]:
    if len(ids) > limits.max_prompt_tokens:
        raise RequestError(name, f"{len(ids)} prompt tokens exceed max_prompt_tokens {limits.max_prompt_tokens}")
    return ids


def parse_request(
    inputs: Mapping[str, np.ndarray], limits: EngineLimits, tokenizer: Tokenizer | None
) -> GenerationRequest:
    """Build a validated request from its input tensors; raises RequestError naming the field."""
    input_ids = _prompt(inputs, limits, tokenizer)
    max_tokens = _one(inputs, "max_tokens", "iu", "INT32")
    if max_tokens is None:
        raise RequestError("max_tokens", "missing")
    max_tokens = int(max_tokens)
    if max_tokens <= 0:
        raise RequestError("max_tokens", f"must be > 0, got {max_tokens}")
    if max_tokens > limits.max_output_tokens:
        raise RequestError("max_tokens", f"{max_tokens} exceeds max_output_tokens {limits.max_output_tokens}")
    if len(input_ids) + max_tokens > limits.max_seq_len:
        raise RequestError(
            "max_tokens",
            f"prompt ({len(input_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {limits.max_seq_len}",
        )
    request = GenerationRequest(input_ids=input_ids, max_tokens=max_tokens,
                                num_draft_tokens=limits.default_num_draft_tokens)

    temperature = _one(inputs, "temperature", "f", "FP32")
    if temperature is not None:
        if math.isnan(temperature) or temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {float(temperature)}")
        request.temperature = float(temperature)
    top_p = _one(inputs, "top_p", "f", "FP32")
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise RequestError("top_p", f"must be in (0, 1], got {float(top_p)}")
        request.top_p = float(top_p)
    top_k = _one(inputs, "top_k", "iu", "INT32")
    if top_k is not None:
        if top_k < 0:
            raise RequestError("top_k", f"must be >= 0, got {int(top_k)}")
        request.top_k = int(top_k)
    seed = _one(inputs, "seed", "iu", "UINT64")
    if seed is not None:
        request.seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    num_draft = _one(inputs, "num_draft_tokens", "iu", "INT32")
    if num_draft is not None:
        if not 0 <= num_draft <= limits.max_draft_tokens:
            raise RequestError(
                "num_draft_tokens", f"must be in [0, {limits.max_draft_tokens}], got {int(num_draft)}"
            )
        request.num_draft_tokens = int(num_draft)
    for flag in ("return_logprobs", "stream"):
        value = _one(inputs, flag, "b", "BOOL")
        if value is not None:
            setattr(request, flag, bool(value))
    if "stop_words" in inputs:
        words = [_text(w, "stop_words") for w in np.asarray(inputs["stop_words"]).reshape(-1)]
        words = [w for w in words if w]
        if words and tokenizer is None:
            raise RequestError("stop_words", "the repository has no tokenizer.json to match text against")
        request.stop_words = words
    return request


def int_parameter(params: Mapping[str, str], key: str, minimum: int, default: int | None = None) -> int:
    """An integer config.pbtxt parameter, checked at load time (ValueError names the key); `default`
    stands in for a parameter a repository from before it does not have."""
    if default is not None and key not in params:
        return default
    return _number_parameter(params, key, minimum, int, "an integer")


def switch_interval_s(params: Mapping[str, str]) -> float | None:
    """The `switch_interval_us` parameter in seconds, for `sys.setswitchinterval`; None where it is 0 or absent
    (Python's own 5 ms stays)."""
    us = int_parameter(params, "switch_interval_us", 0, default=0)
    return us / 1e6 if us else None


def flag_parameter(params: Mapping[str, str], key: str, default: bool = False) -> bool:
    """A true/false config.pbtxt parameter, checked at load time (ValueError names the key); `default`
    stands in for a parameter a repository from before it does not have."""
    value = params.get(key, "true" if default else "false")
    if value not in ("true", "false"):
        raise ValueError(f"config.pbtxt: parameter {key!r} must be true or false, got {value!r}")
    return value == "true"


def float_parameter(params: Mapping[str, str], key: str, minimum: float) -> float:
    """A finite float config.pbtxt parameter, checked at load time (ValueError names the key)."""
    return _number_parameter(params, key, minimum, float, "a finite number")


def _number_parameter(params: Mapping[str, str], key: str, minimum: float, parse, what: str):
    if key not in params:
        raise ValueError(f"config.pbtxt: parameter {key!r} is missing")
    try:
        value = parse(params[key])
    except ValueError:
        raise ValueError(f"config.pbtxt: parameter {key!r} must be {what}, got {params[key]!r}") from None
    if not value >= minimum or math.isinf(value):  # NaN fails the comparison
        raise ValueError(f"config.pbtxt: parameter {key!r} must be {what} >= {minimum}, got {value}")
    return value


def default_limits(max_seq_len: int) -> dict[str, int | float]:
    """Request limits a repository gets unless the export sets them (safe for any max_seq_len)."""
    return {
        "max_prompt_bytes": 16 * max_seq_len,  # byte-level BPE averages 3-5 bytes per token on code and prose
        "max_prompt_tokens": max_seq_len - 1,
        "max_output_tokens": max_seq_len - 1,
        "request_timeout_s": 600.0,
    }


def in_process_limits(vocab_size: int, max_slots: int, max_seq_len: int, max_draft_tokens: int, max_queue_size: int,
                      default_num_draft_tokens: int = 0, eos_token_id: int = -1) -> EngineLimits:
    """The limits of an engine run in process (benchmarks, acceptance runs): these sizes, `default_limits`."""
    return EngineLimits(max_slots=max_slots, max_seq_len=max_seq_len, vocab_size=vocab_size,
                        max_draft_tokens=max_draft_tokens, default_num_draft_tokens=default_num_draft_tokens,
                        eos_token_id=eos_token_id, max_queue_size=max_queue_size, **default_limits(max_seq_len))


def engine_limits(params: Mapping[str, str]) -> EngineLimits:
    """The `spec_decode` model's limits from its config.pbtxt parameters.

    The request limits (`max_prompt_bytes`, `max_prompt_tokens`, `max_output_tokens`,
    `request_timeout_s`) fall back to `default_limits` when a repository predates them.
    """
    num_mtp_layers = int_parameter(params, "num_mtp_layers", 0)
    max_draft = int_parameter(params, "max_draft_tokens", 0) if num_mtp_layers else 0
    max_seq_len = int_parameter(params, "max_seq_len", 2)
    params = {**{k: str(v) for k, v in default_limits(max_seq_len).items()}, **params}
    limits = EngineLimits(
        max_slots=int_parameter(params, "max_slots", 1),
        max_seq_len=max_seq_len,
        vocab_size=int_parameter(params, "vocab_size", 1),
        max_draft_tokens=max_draft,
        default_num_draft_tokens=int_parameter(params, "default_num_draft_tokens", 0),
        eos_token_id=int_parameter(params, "eos_token_id", -1),
        max_queue_size=int_parameter(params, "max_queue_size", 0),
        max_prompt_bytes=int_parameter(params, "max_prompt_bytes", 1),
        max_prompt_tokens=int_parameter(params, "max_prompt_tokens", 1),
        max_output_tokens=int_parameter(params, "max_output_tokens", 1),
        request_timeout_s=float_parameter(params, "request_timeout_s", 0.0),
    )
    if num_mtp_layers and limits.default_num_draft_tokens > max_draft:
        raise ValueError(
            f"config.pbtxt: parameter 'default_num_draft_tokens' ({limits.default_num_draft_tokens}) "
            f"exceeds 'max_draft_tokens' ({max_draft})"
        )
    if not num_mtp_layers:
        limits = dataclasses.replace(limits, default_num_draft_tokens=0)
    return limits


class TokenizerFile:
    """A `tokenizer.json` (Hugging Face tokenizers) as the engine's Tokenizer."""

    def __init__(self, path: str | Path) -> None:
        self._tokenizer = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def decode_stream(self) -> TextStream:
        return _TokenizerStream(self._tokenizer)


class _TokenizerStream:
    """tokenizers' DecodeStream bound to its tokenizer; its steps concatenate to `decode(ids)`."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""
