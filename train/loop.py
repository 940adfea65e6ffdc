"""Training loop of the bundled model: corpus → tokenizer → token streams → AdamW steps → checkpoint."""
from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3Config

from triton_mtp.train.config import bundled_model_config
from triton_mtp.train.corpus import Split, split_stdlib
from triton_mtp.train.objective import (
    LoadBalancer, TrainingModel, checkpoint_state_dict, depth_losses, draft_agreement, mtp_lambda, objective,
)
from triton_mtp.train.tokenizer import encode_documents, save_tokenizer, train_tokenizer

FP32_KEYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # kept float32, as DeepSeek ships them


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything that determines a run; with the same corpus, the same settings give the same model.

    The defaults are the settings of the bundled checkpoint's run.
    """

    steps: int = 2400
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    vocab_size: int = 8192
    eval_every: int = 200
    eval_windows: int = 128
    log_every: int = 10
    max_files: int | None = None  # first N files of each split (smoke runs); None = all


@dataclasses.dataclass
class Corpus:
    """Tokenizer plus the train / held-out splits as flat token streams (documents end with <|eos|>)."""

    split: Split
    tokenizer: Tokenizer
    train_ids: torch.Tensor  # N_train int64
    held_out_ids: torch.Tensor  # N_held int64

    def stats(self) -> dict[str, Any]:
        return {
            "root": str(self.split.root), "python": platform.python_version(),
            "train_files": len(self.split.train), "held_out_files": len(self.split.held_out),
            "train_tokens": self.train_ids.numel(), "held_out_tokens": self.held_out_ids.numel(),
        }


def prepare_corpus(settings: TrainSettings, root: Path | None = None) -> Corpus:
    """Split the standard library, train the tokenizer on the train split, tokenize both splits."""
    split = split_stdlib(root)
    if settings.max_files is not None:
        split = dataclasses.replace(split, train=split.train[:settings.max_files],
                                    held_out=split.held_out[:settings.max_files])
    train_texts = [split.read(p) for p in split.train]
    tokenizer = train_tokenizer(train_texts, settings.vocab_size)
    held_texts = [split.read(p) for p in split.held_out]
    return Corpus(split, tokenizer, _stream(tokenizer, train_texts), _stream(tokenizer, held_texts))


def _stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    return torch.tensor([t for doc in encode_documents(tokenizer, texts) for t in doc], dtype=torch.int64)


def sample_windows(ids: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens from the stream `ids` -> [batch, length]."""
    if ids.numel() <= length:
        raise ValueError(f"train split: {ids.numel()} tokens, not more than one window of {length}")
    starts = torch.randint(0, ids.numel() - length, (batch, 1), generator=generator)  # B, 1
    return ids[starts + torch.arange(length)]  # B, L


def held_out_windows(ids: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` evenly spaced windows of the held-out stream -> [count, length] (the same every run)."""
    if ids.numel() <= length:
        raise ValueError(f"held-out split: {ids.numel()} tokens, not more than one window of {length}")
    starts = torch.linspace(0, ids.numel() - length - 1, count).long().unsqueeze(1)  # count, 1
    return ids[starts + torch.arange(length)]  # count, L


def lr_factor(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio`."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class Trainer:
    """One training run on `device`; `step()` advances by one optimizer step."""

    def __init__(self, settings: TrainSettings, corpus: Corpus, device: str):
        self.settings, self.corpus, self.device = settings, corpus, torch.device(device)
        torch.manual_seed(settings.seed)
        self.config_dict = bundled_model_config(corpus.tokenizer.get_vocab_size())
        self.model = TrainingModel(DeepseekV3Config(**self.config_dict)).to(self.device)
        self.balancer = LoadBalancer(self.model)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]  # matrices; not norms
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=(0.9, 0.95),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, settings))
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.held_out = held_out_windows(corpus.held_out_ids, settings.eval_windows, settings.seq_len + 1)
        self.step_index = 0

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def step(self) -> dict[str, Any]:
        s = self.settings
        tokens = sample_windows(self.corpus.train_ids, s.batch_size, s.seq_len + 1, self.generator)  # B, L
        weight = mtp_lambda(self.step_index, s.steps)
        self.model.train()
        with self._autocast():
            losses = depth_losses(self.model(tokens.to(self.device)), tokens.to(self.device))
            loss = objective(losses, weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.balancer.update()
        self.step_index += 1
        return {"step": self.step_index, "loss": loss.item(), "lambda": weight,
                "lr": self.scheduler.get_last_lr()[0], "depth_loss": [x.item() for x in losses]}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out loss per depth and teacher-forced greedy draft agreement per MTP depth."""
        self.model.eval()
        totals, agree, batches = None, None, 0
        for tokens in self.held_out.split(self.settings.batch_size):
            tokens = tokens.to(self.device)  # b, L
            with self._autocast():
                logits = self.model(tokens)
                losses = [x.item() for x in depth_losses(logits, tokens)]
            a = draft_agreement(logits)
            totals = losses if totals is None else [t + x for t, x in zip(totals, losses)]
            agree = a if agree is None else [t + x for t, x in zip(agree, a)]
            batches += 1
        return {"step": self.step_index, "held_out_loss": [t / batches for t in totals],
                "held_out_agreement": [t / batches for t in agree]}

    def save(self, out_dir: Path) -> None:
        """Write config.json, model.safetensors (bf16; router in fp32) and the tokenizer files."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(torch.float32 if k.endswith(FP32_KEYS) else torch.bfloat16).cpu()
                   for k, v in checkpoint_state_dict(self.model).items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(self.config_dict, indent=2) + "\n")
        save_tokenizer(self.corpus.tokenizer, out_dir, self.config_dict["max_position_embeddings"])


def measure_step_seconds(settings: TrainSettings, corpus: Corpus, device: str, steps: int = 8) -> float:
    """Seconds per optimizer step on `device`, from a throwaway model (first two steps not timed)."""
    trainer = Trainer(settings, corpus, device)
    for _ in range(2):
        trainer.step()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    return (time.perf_counter() - start) / steps


def train(settings: TrainSettings, corpus: Corpus, out_dir: Path, device: str,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `settings.steps` steps, evaluating every `eval_every`; write the checkpoint and logs to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(settings, corpus, device)
    start = time.perf_counter()
    with open(out_dir / "train_log.jsonl", "w") as log_file:
        def record(entry: dict[str, Any]) -> None:
            entry["seconds"] = round(time.perf_counter() - start, 2)
            log_file.write(json.dumps(entry) + "\n")
            log(json.dumps(entry))

        record(trainer.evaluate())
        while trainer.step_index < settings.steps:
            entry = trainer.step()
            if trainer.step_index % settings.log_every == 0 or trainer.step_index == settings.steps:
                record(entry)
            if trainer.step_index % settings.eval_every == 0 or trainer.step_index == settings.steps:
                record(trainer.evaluate())
        final = trainer.evaluate()
    trainer.save(out_dir)
    summary = {"settings": dataclasses.asdict(settings), "corpus": corpus.stats(), "device": device,
               "train_seconds": round(time.perf_counter() - start, 1), "final": final}
    (out_dir / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
