"""`triton-mtp train`: train the bundled tiny DeepSeek-V3 + MTP checkpoint from a fixed seed."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

from triton_mtp.train.loop import TrainSettings, measure_step_seconds, prepare_corpus, train
from triton_mtp.train.tokenizer import SPECIAL_TOKENS

_DEFAULTS = TrainSettings()
_POSITIVE = ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "eval_every", "eval_windows", "log_every",
             "max_files")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train the bundled tiny DeepSeek-V3 + MTP model",
                              description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="standard library directory (default: this interpreter's)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="measure the step time and stop at the last step that fits (caps --steps)")
    for field in dataclasses.fields(TrainSettings):
        default = getattr(_DEFAULTS, field.name)
        kind = float if isinstance(default, float) else int
        p.add_argument("--" + field.name.replace("_", "-"), type=kind, default=default)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)})
    for name in _POSITIVE:
        value = getattr(settings, name)
        if value is not None and value <= 0:
            raise SystemExit(f"triton-mtp train: --{name.replace('_', '-')} must be positive, got {value}")
    if settings.vocab_size < MIN_VOCAB:
        raise SystemExit(f"triton-mtp train: --vocab-size must be at least {MIN_VOCAB} (bytes + specials)")
    try:
        corpus = prepare_corpus(settings, args.corpus_root)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"triton-mtp train: {exc}") from None
    print(json.dumps({"corpus": corpus.stats()}), flush=True)
    if args.time_budget is not None:
        seconds = measure_step_seconds(settings, corpus, args.device)
        fit = max(1, math.floor(0.95 * args.time_budget / seconds))
        settings = dataclasses.replace(settings, steps=min(settings.steps, fit))
        print(json.dumps({"step_seconds": round(seconds, 4), "steps": settings.steps}), flush=True)
    summary = train(settings, corpus, args.out, args.device, log=lambda line: print(line, flush=True))
    try:
        from triton_mtp.train.plot import plot_losses
        plot_losses(args.out / "train_log.jsonl", args.out / "loss_curve.png")
    except ImportError:
        print("matplotlib is not installed: skipped loss_curve.png "
              f"(later: python -m triton_mtp.train.plot {args.out}/train_log.jsonl loss_curve.png)")
    print(json.dumps({"final": summary["final"], "steps": settings.steps}), flush=True)
    return 0
