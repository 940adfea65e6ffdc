"""`triton-mtp eval-acceptance`: greedy MTP acceptance of a checkpoint on held-out standard-library code.

The prompts are a fixed sample of the held-out split (`train/corpus.py`): the first `num_prompts`
held-out files in path order, each cut to `prompt_tokens` tokens from the middle of the file. They
go through the real engine (the continuous-batching scheduler over the target and MTP workers, in
this process) with greedy decoding and `num_draft_tokens` drafts per step. Reported per draft
position k: the fraction of drafts whose k-th token was accepted; and the mean accepted length
1 + accepted / drafts (it counts the bonus or recovered token).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import torch

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.serving.requests import (
    GenerationRequest, TokenizerFile, in_process_limits,
)
from triton_mtp.serving.scheduler import FinalResponse, Scheduler
from triton_mtp.serving.workers import DraftWorker, InProcessHops, TargetWorker, verify_window
from triton_mtp.train.config import BUNDLED_CHECKPOINT
from triton_mtp.train.corpus import split_stdlib

CARD_BEGIN, CARD_END = "<!-- acceptance:begin -->", "<!-- acceptance:end -->"


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Engine counters of one evaluation."""

    num_prompts: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    emitted_tokens: int
    hops: int

    @property
    def per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def markdown(self) -> str:
        """The acceptance table (one row per draft position) plus the mean accepted length."""
        rows = ["| draft position k | acceptance |", "|---|---|"]
        rows += [f"| {k} | {rate:.3f} |" for k, rate in enumerate(self.per_position, start=1)]
        rows.append(f"\nMean accepted length: **{self.mean_accepted_length:.2f}** tokens per target step "
                    f"({self.num_drafts} drafts, {self.emitted_tokens} emitted tokens, "
                    f"{self.hops / max(self.emitted_tokens, 1):.2f} hops per emitted token with all {self.num_prompts} "
                    "prompts batched).")
        return "\n".join(rows)


def held_out_prompts(tokenizer: TokenizerFile, num_prompts: int, prompt_tokens: int,
                     corpus_root: Path | None = None) -> list[list[int]]:
    """The fixed held-out sample: `prompt_tokens` ids from the middle of each of the first held-out files."""
    split = split_stdlib(corpus_root)
    prompts = []
    for path in split.held_out:
        ids = tokenizer.encode(split.read(path))
        if len(ids) < 2 * prompt_tokens:
            continue
        start = len(ids) // 2
        prompts.append(ids[start:start + prompt_tokens])
        if len(prompts) == num_prompts:
            return prompts
    raise ValueError(f"held-out split: only {len(prompts)} files have {2 * prompt_tokens}+ tokens, "
                     f"{num_prompts} prompts asked")


def evaluate(checkpoint: Path, prompts: list[list[int]], max_tokens: int, num_draft_tokens: int) -> Acceptance:
    """Greedy speculative decoding of every prompt through the engine; the engine's acceptance counters."""
    max_seq_len = max(len(p) for p in prompts) + max_tokens + num_draft_tokens + 1
    config, target, mtp = load_checkpoint(checkpoint, dtype=torch.float32, max_slots=len(prompts),
                                          max_seq_len=max_seq_len, progress=False)
    if mtp is None:
        raise ValueError(f"{checkpoint}: the checkpoint has no MTP layers")
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else -1
    limits = in_process_limits(config.vocab_size, len(prompts), max_seq_len, num_draft_tokens, len(prompts),
                               default_num_draft_tokens=num_draft_tokens, eos_token_id=eos)
    hops = InProcessHops(TargetWorker(verify_window(target), len(prompts)),
                         DraftWorker(mtp, config.num_nextn_predict_layers, len(prompts)))
    engine = Scheduler(hops, limits)
    handles = [FinalResponse() for _ in prompts]
    for ids, handle in zip(prompts, handles):
        engine.submit(GenerationRequest(input_ids=ids, max_tokens=max_tokens,
                                        num_draft_tokens=num_draft_tokens), handle)
    engine.run_until_idle()
    for handle in handles:
        if handle.error is not None or handle.final is None:
            raise RuntimeError(f"spec_decode: request failed: {handle.error}")
    counters = engine.metrics.counters
    return Acceptance(
        num_prompts=len(prompts), num_drafts=counters["spec_decode_num_drafts"],
        num_draft_tokens=counters["spec_decode_num_draft_tokens"],
        num_accepted_tokens=counters["spec_decode_num_accepted_tokens"],
        accepted_per_position=list(engine.metrics.accepted_per_position),
        emitted_tokens=counters["spec_decode_emitted_tokens"], hops=counters["spec_decode_hops"],
    )


def write_into_card(card: Path, table: str) -> None:
    """Replace the text between the acceptance markers of the model card."""
    text = card.read_text()
    pattern = re.compile(re.escape(CARD_BEGIN) + ".*?" + re.escape(CARD_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{card}: no '{CARD_BEGIN}' ... '{CARD_END}' section to write the table into")
    card.write_text(pattern.sub(lambda _: f"{CARD_BEGIN}\n{table}\n{CARD_END}", text))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval-acceptance", help="greedy MTP acceptance on held-out code",
                              description=__doc__)
    p.add_argument("--checkpoint", type=Path, default=BUNDLED_CHECKPOINT)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="standard library directory (default: this interpreter's)")
    p.add_argument("--model-card", type=Path, default=None,
                   help=f"write the table between {CARD_BEGIN} and {CARD_END} of this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "prompt_tokens", "max_tokens", "num_draft_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"triton-mtp eval-acceptance: --{name.replace('_', '-')} must be >= 1")
    tokenizer_path = args.checkpoint / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise SystemExit(f"triton-mtp eval-acceptance: {tokenizer_path}: file not found")
    tokenizer = TokenizerFile(tokenizer_path)
    prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.corpus_root)
    result = evaluate(args.checkpoint, prompts, args.max_tokens, args.num_draft_tokens)
    table = result.markdown()
    print(table)
    print(json.dumps({"per_position": result.per_position, "mean_accepted_length": result.mean_accepted_length}))
    if args.model_card is not None:
        write_into_card(args.model_card, table)
    return 0
