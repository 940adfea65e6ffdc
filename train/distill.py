"""Phase 2 of the bundled model: the target frozen, the MTP layers trained by self-distillation.

Greedy acceptance is agreement of the MTP drafts with the target's own predictions, so phase 2 fits the
MTP depth-k distribution at row i to the target's distribution for the same token i+k+1 (the target's
softmax at row i+k, detached), as EAGLE (Li et al. 2024) and Medusa-2 (Cai et al. 2024) train their
drafters on the frozen model's outputs:

    loss = mean_k KL(p_target(· | row i+k) ‖ q_MTP_k(· | row i)) + ce_weight · mean_k CE(MTP_k)

Only `model.layers.{N+i}.*` change; the embedding and head the MTP shares with the target stay frozen.

Depth k runs the layers the way `serving/workers.py` DraftWorker runs them (layer (k-1) % D). Prefill
writes the cache of every layer a request drafts with: the target pairs (embed(t[j+1]), h^0[j]) at
position j; draft step m then writes the chain pair (embed(t[i+m+1]), h^m[i]) at position i+m, where h^m is the output of depth m
after `shared_head.norm`. So depth k's query is the last chain pair and attends to the target pairs at
positions <= i and the chain pairs i+1..i+k-1 of its own row: `serving_mask` builds that pattern over
one sequence [target pairs | chain 1 | ... | chain k-1].
"""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.utils import logging as hf_logging

from triton_mtp.train.corpus import split_stdlib
from triton_mtp.train.loop import FP32_KEYS, Corpus, held_out_windows, lr_factor, sample_windows
from triton_mtp.train.objective import LoadBalancer, TrainingModel, checkpoint_state_dict
from triton_mtp.train.tokenizer import encode_documents

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Everything that determines a phase-2 run besides the starting checkpoint and the corpus."""

    steps: int = 5000
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ce_weight: float = 0.0
    seed: int = 0
    eval_every: int = 250
    eval_windows: int = 128
    log_every: int = 10
    max_files: int | None = None


def load_training_model(checkpoint: Path) -> TrainingModel:
    """The checkpoint's target and MTP layers as a float32 `TrainingModel` (transformers does the loading)."""
    config = DeepseekV3Config.from_pretrained(checkpoint)
    n, depth = config.num_hidden_layers, config.num_nextn_predict_layers
    if not depth:
        raise ValueError(f"{checkpoint}/config.json: num_nextn_predict_layers is {depth}, no MTP layers to train")
    stacked_config = copy.deepcopy(config)  # MTP layer i loads as decoder layer N+i (experts fused on load)
    stacked_config.num_hidden_layers = n + depth
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # enorm / hnorm / eh_proj / shared_head are unexpected there
    try:
        stacked = DeepseekV3ForCausalLM.from_pretrained(checkpoint, config=stacked_config, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model = TrainingModel(config)
    layers = stacked.model.layers
    target_state = {k: v for k, v in stacked.state_dict().items() if not _is_mtp_key(k, n)}
    model.target.load_state_dict(target_state, strict=True)
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        for i, layer in enumerate(model.mtp):
            missing = set(layer.load_state_dict(layers[n + i].state_dict(), strict=False).missing_keys)
            layer.load_state_dict({k: f.get_tensor(f"model.layers.{n + i}.{k}").float() for k in missing},
                                  strict=False)
        for name, value in checkpoint_state_dict(model).items():
            stored = f.get_tensor(name)
            if not torch.equal(value.to(stored.dtype), stored):
                raise ValueError(f"{checkpoint}/model.safetensors: {name} did not load as stored")
    return model


def _is_mtp_key(name: str, n: int) -> bool:
    parts = name.split(".")
    return parts[:2] == ["model", "layers"] and int(parts[2]) >= n


def checkpoint_corpus(checkpoint: Path, max_files: int | None = None, root: Path | None = None) -> Corpus:
    """The standard-library split tokenized with the checkpoint's own tokenizer."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    tokenizer = Tokenizer.from_file(str(path))
    split = split_stdlib(root)
    if max_files is not None:
        split = dataclasses.replace(split, train=split.train[:max_files], held_out=split.held_out[:max_files])

    def stream(files: list[str]) -> torch.Tensor:
        docs = encode_documents(tokenizer, [split.read(p) for p in files])
        return torch.tensor([t for doc in docs for t in doc], dtype=torch.int64)

    return Corpus(split, tokenizer, stream(split.train), stream(split.held_out))


def serving_mask(n: int, depth: int, device: torch.device) -> torch.Tensor:
    """Attention pattern of depth `depth` over [target pairs | chain 1 | ... | chain depth-1], n rows each.

    -> mask[1, 1, depth*n, depth*n] bool: target pair j attends target pairs <= j; chain pair m of row i
    attends target pairs <= i and chain pairs 1..m of row i.
    """
    index = torch.arange(depth * n, device=device)  # depth*n
    block, row = index // n, index % n  # depth*n, depth*n
    q_block, q_row, k_block, k_row = block[:, None], row[:, None], block[None, :], row[None, :]
    target_keys = (k_block == 0) & (k_row <= q_row)  # depth*n, depth*n
    chain_keys = (k_block >= 1) & (k_block <= q_block) & (k_row == q_row)  # depth*n, depth*n
    return (target_keys | chain_keys)[None, None]  # 1, 1, depth*n, depth*n


def serving_forward(model: TrainingModel, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """tokens[B,L] -> target logits[B,L,V] (no grad), MTP depth k logits[B,L-k,V] for k = 1..D.

    Row i of depth k predicts token i+k+1 from the inputs DraftWorker gives layer (k-1) % D.
    """
    B, L = tokens.shape  # batch, window length
    base = model.target.model
    positions = torch.arange(L, device=tokens.device).unsqueeze(0)  # 1, L
    with torch.no_grad():
        target_hidden = base(input_ids=tokens, position_ids=positions).last_hidden_state  # B, L, H
        target_logits = model.target.lm_head(target_hidden)  # B, L, V
        embeds = base.embed_tokens(tokens)  # B, L, H
    chain: list[torch.Tensor] = []  # h^m[B, rows, H], after shared_head.norm
    logits = []
    for k in range(1, len(model.mtp) + 1):
        n = L - k
        hidden = [target_hidden[:, :n]] + [h[:, :n] for h in chain]  # depth k's blocks, each B, n, H
        tokens_in = [embeds[:, m + 1:m + 1 + n] for m in range(k)]  # block m pairs token i+m+1; B, n, H
        pos = torch.cat([positions[:, :n] + m for m in range(k)], 1)  # 1, k*n
        layer = model.mtp[(k - 1) % len(model.mtp)]
        out = layer(torch.cat(hidden, 1), torch.cat(tokens_in, 1), pos, base.rotary_emb,
                    attention_mask=serving_mask(n, k, tokens.device))  # B, k*n, H
        chain.append(out[:, (k - 1) * n:])  # B, n, H: the query block
        logits.append(model.target.lm_head(chain[-1]))  # B, n, V
    return target_logits, logits


def distill_losses(target_logits: torch.Tensor, mtp_logits: list[torch.Tensor], tokens: torch.Tensor
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per depth: KL(target at row i+k ‖ MTP_k at row i) and CE(MTP_k, token i+k+1)."""
    kls, ces = [], []
    for k, lg in enumerate(mtp_logits, start=1):
        log_q = F.log_softmax(lg.float(), -1).flatten(0, 1)  # B*n, V
        log_p = F.log_softmax(target_logits[:, k:].float(), -1).flatten(0, 1)  # B*n, V
        kls.append(F.kl_div(log_q, log_p, log_target=True, reduction="batchmean"))
        ces.append(F.cross_entropy(lg[:, :-1].flatten(0, 1).float(), tokens[:, k + 1:].flatten()))
    return kls, ces


def target_agreement(target_logits: torch.Tensor, mtp_logits: list[torch.Tensor]) -> list[float]:
    """Teacher-forced greedy acceptance per depth: MTP_k's argmax at row i equals the target's at i+k."""
    target = target_logits.argmax(-1)  # B, L
    return [(lg.argmax(-1) == target[:, k:]).float().mean().item() for k, lg in enumerate(mtp_logits, start=1)]


class Distiller:
    """Phase-2 run on `device`: AdamW on the MTP layers only; `step()` advances by one optimizer step."""

    def __init__(self, settings: DistillSettings, corpus: Corpus, checkpoint: Path, device: str):
        self.settings, self.corpus, self.checkpoint = settings, corpus, checkpoint
        self.device = torch.device(device)
        torch.manual_seed(settings.seed)
        self.model = load_training_model(checkpoint).to(self.device)
        self.model.target.requires_grad_(False).eval()
        self.balancer = LoadBalancer(self.model.mtp)
        params = list(self.model.mtp.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=settings.lr, betas=(0.9, 0.95),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, settings))
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.held_out = held_out_windows(corpus.held_out_ids, settings.eval_windows, settings.seq_len + 1)
        self.step_index = 0

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def _losses(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, Any]]:
        with self._autocast():
            target_logits, mtp_logits = serving_forward(self.model, tokens)
            kls, ces = distill_losses(target_logits, mtp_logits, tokens)
            target_ce = F.cross_entropy(target_logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss = torch.stack(kls).mean() + self.settings.ce_weight * torch.stack(ces).mean()
        return loss, mtp_logits, {"target_logits": target_logits, "kl": [x.item() for x in kls],
                                  "depth_loss": [target_ce.item()] + [x.item() for x in ces]}

    def step(self) -> dict[str, Any]:
        s = self.settings
        tokens = sample_windows(self.corpus.train_ids, s.batch_size, s.seq_len + 1, self.generator)  # B, L
        self.model.mtp.train()
        loss, _, info = self._losses(tokens.to(self.device))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.mtp.parameters(), s.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.balancer.update()
        self.step_index += 1
        return {"step": self.step_index, "loss": loss.item(), "lr": self.scheduler.get_last_lr()[0],
                "distill_kl": info["kl"], "depth_loss": info["depth_loss"]}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out KL and CE per depth (target CE first) and teacher-forced agreement with the target."""
        self.model.mtp.eval()
        sums: dict[str, list[float]] = {}
        batches = 0
        for tokens in self.held_out.split(self.settings.batch_size):
            _, mtp_logits, info = self._losses(tokens.to(self.device))
            values = {"held_out_kl": info["kl"], "held_out_loss": info["depth_loss"],
                      "held_out_agreement": target_agreement(info["target_logits"], mtp_logits)}
            for key, v in values.items():
                sums[key] = v if key not in sums else [a + b for a, b in zip(sums[key], v)]
            batches += 1
        return {"step": self.step_index, **{k: [x / batches for x in v] for k, v in sums.items()}}

    def save(self, out_dir: Path) -> None:
        """Write the checkpoint in the layout it was read in: config and tokenizer copied, weights bf16."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(torch.float32 if k.endswith(FP32_KEYS) else torch.bfloat16).cpu()
                   for k, v in checkpoint_state_dict(self.model).items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json",) + TOKENIZER_FILES:
            if (self.checkpoint / name).is_file():
                shutil.copyfile(self.checkpoint / name, out_dir / name)


def measure_step_seconds(settings: DistillSettings, corpus: Corpus, checkpoint: Path, device: str,
                         steps: int = 8) -> float:
    """Seconds per phase-2 step on `device`, from a throwaway run (first two steps not timed)."""
    distiller = Distiller(settings, corpus, checkpoint, device)
    for _ in range(2):
        distiller.step()
    start = time.perf_counter()
    for _ in range(steps):
        distiller.step()
    return (time.perf_counter() - start) / steps


def distill(settings: DistillSettings, corpus: Corpus, checkpoint: Path, out_dir: Path, device: str,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `settings.steps` phase-2 steps from `checkpoint`; write the new checkpoint and logs to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    distiller = Distiller(settings, corpus, checkpoint, device)
    start = time.perf_counter()
    with open(out_dir / "distill_log.jsonl", "w") as log_file:
        def record(entry: dict[str, Any]) -> None:
            entry["seconds"] = round(time.perf_counter() - start, 2)
            log_file.write(json.dumps(entry) + "\n")
            log(json.dumps(entry))

        initial = distiller.evaluate()
        record(dict(initial))
        while distiller.step_index < settings.steps:
            entry = distiller.step()
            if distiller.step_index % settings.log_every == 0 or distiller.step_index == settings.steps:
                record(entry)
            if distiller.step_index % settings.eval_every == 0 and distiller.step_index < settings.steps:
                record(distiller.evaluate())
        final = distiller.evaluate()
        record(dict(final))
    distiller.save(out_dir)
    summary = {"settings": dataclasses.asdict(settings), "from": str(checkpoint), "corpus": corpus.stats(),
               "device": device, "train_seconds": round(time.perf_counter() - start, 1),
               "initial": initial, "final": final}
    (out_dir / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
