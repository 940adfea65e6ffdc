"""What every benchmark shares: held-out code prompts, latency statistics and result files.

Prompts are the held-out split of the bundled model's corpus (the Python standard library, split by
`triton_mtp.train.corpus.is_held_out`): each prompt starts at a file's first top-level `def` or
`class` and is cut to `prompt_tokens` tokens of the checkpoint's `tokenizer.json`. A checkpoint
without a tokenizer (a synthetic one) gets the UTF-8 bytes of the same text, modulo its vocabulary.
"""
from __future__ import annotations

import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triton_mtp.train.corpus import split_stdlib

_CODE_START = re.compile(r"^(def|class) ", re.MULTILINE)


def bench_max_seq_len(prompt_tokens: int, max_tokens: int, max_draft: int) -> int:
    """The KV cache length of the benchmarks' exports and loops: the requests, then room for a chained verify
    window launched ahead from a row's last tokens (the host's worst case: two calls' tokens and a window of k
    drafts past the last), so that chains hold to the end of a request (serving/scheduler.py `_chains`)."""
    return prompt_tokens + max_tokens + 3 * max_draft + 2


def held_out_prompts(checkpoint: str | Path, count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` prompts of exactly `prompt_tokens` token ids from held-out standard-library files."""
    checkpoint = Path(checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    tokenizer_file = checkpoint / "tokenizer.json"
    encode = _byte_encoder(vocab)
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    split = split_stdlib()
    prompts = []
    for path in split.held_out:
        text = split.read(path)
        match = _CODE_START.search(text)
        if match is None:
            continue
        ids = encode(text[match.start():])
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"held-out split: only {len(prompts)} files give {prompt_tokens}-token prompts, {count} asked")


def _byte_encoder(vocab: int):
    return lambda text: [b % vocab for b in text.encode("utf-8")]


def latency_summary(seconds: list[float]) -> dict[str, float]:
    """p50 / p99 / mean in milliseconds (zeros when there is nothing to summarise)."""
    if not seconds:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0}
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def acceptance_summary(accepted_per_position: list[int], num_drafts: int, accepted: int) -> dict[str, Any]:
    """Per-position acceptance rate and mean accepted length (1 + accepted / drafts, vLLM's convention)."""
    return {
        "acceptance_per_position": [a / num_drafts if num_drafts else 0.0 for a in accepted_per_position],
        "mean_accepted_length": 1 + accepted / num_drafts if num_drafts else 1.0,
        "num_drafts": num_drafts,
        "accepted_draft_tokens": accepted,
    }


def environment() -> dict[str, Any]:
    """Host, Python, torch and device versions recorded next to every result."""
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "host": platform.node(),
            "cpu": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write one benchmark's result as indented JSON (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_time(step, inputs: tuple[torch.Tensor, ...], device: torch.device, repeats: int) -> float:
    """Mean seconds per call of `step(*inputs)` after warm-up."""
    for _ in range(3):
        step(*inputs)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step(*inputs)
    synchronize(device)
    return (time.perf_counter() - start) / repeats
