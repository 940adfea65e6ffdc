"""`triton-mtp train`: train the bundled tiny DeepSeek-V3 + MTP checkpoint from a fixed seed.

With `--distill-from CKPT` it runs phase 2 instead: the target of CKPT frozen, its MTP layers trained by
self-distillation (`triton_mtp.train.distill`); the setting flags then default to phase 2's settings.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

from triton_mtp.train import distill as phase2
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
    p.add_argument("--distill-from", type=Path, default=None, metavar="CKPT",
                   help="phase 2: freeze the target of CKPT and distill it into CKPT's MTP layers")
    for name, field in _SETTING_FLAGS.items():
        kind = float if isinstance(field.default, float) else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"default {_default_text(name)}")
    p.set_defaults(func=run)


_SETTING_FLAGS = {f.name: f for f in dataclasses.fields(TrainSettings) + dataclasses.fields(phase2.DistillSettings)}
_DISTILL_DEFAULTS = phase2.DistillSettings()


def _default_text(name: str) -> str:
    train_default = getattr(_DEFAULTS, name, "-")
    distill_default = getattr(_DISTILL_DEFAULTS, name, "-")
    return f"{train_default} (with --distill-from: {distill_default})"


def _settings(args: argparse.Namespace, kind: type) -> TrainSettings | phase2.DistillSettings:
    names = {f.name for f in dataclasses.fields(kind)}
    for name in _SETTING_FLAGS.keys() - names:
        if getattr(args, name) is not None:
            mode = "without" if kind is TrainSettings else "with"
            raise SystemExit(f"triton-mtp train: --{name.replace('_', '-')} does not apply {mode} --distill-from")
    settings = kind(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    for name in _POSITIVE:
        value = getattr(settings, name)
        if value is not None and value <= 0:
            raise SystemExit(f"triton-mtp train: --{name.replace('_', '-')} must be positive, got {value}")
    return settings


def run(args: argparse.Namespace) -> int:
    if args.distill_from is not None:
        return run_distill(args)
    settings = _settings(args, TrainSettings)
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
    _plot(args.out / "train_log.jsonl", args.out / "loss_curve.png")
    print(json.dumps({"final": summary["final"], "steps": settings.steps}), flush=True)
    return 0


def run_distill(args: argparse.Namespace) -> int:
    """Phase 2 from `--distill-from`: frozen target, MTP layers trained by self-distillation."""
    settings = _settings(args, phase2.DistillSettings)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (args.distill_from / name).is_file():
            raise SystemExit(f"triton-mtp train: --distill-from {args.distill_from / name}: file not found")
    try:
        corpus = phase2.checkpoint_corpus(args.distill_from, settings.max_files, args.corpus_root)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"triton-mtp train: {exc}") from None
    print(json.dumps({"corpus": corpus.stats()}), flush=True)
    if args.time_budget is not None:
        seconds = phase2.measure_step_seconds(settings, corpus, args.distill_from, args.device)
        fit = max(1, math.floor(0.95 * args.time_budget / seconds))
        settings = dataclasses.replace(settings, steps=min(settings.steps, fit))
        print(json.dumps({"step_seconds": round(seconds, 4), "steps": settings.steps}), flush=True)
    summary = phase2.distill(settings, corpus, args.distill_from, args.out, args.device,
                             log=lambda line: print(line, flush=True))
    _plot(args.out / "distill_log.jsonl", args.out / "distill_curve.png")
    print(json.dumps({"initial": summary["initial"], "final": summary["final"], "steps": settings.steps}),
          flush=True)
    return 0


def _plot(log_path: Path, png_path: Path) -> None:
    try:
        from triton_mtp.train.plot import plot_losses
        plot_losses(log_path, png_path)
    except ImportError:
        print(f"matplotlib is not installed: skipped {png_path.name} "
              f"(later: python -m triton_mtp.train.plot {log_path} {png_path.name})")
