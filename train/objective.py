"""Training forward and objective of the bundled model (DeepSeek-V3 §2.2).

The target is transformers' `DeepseekV3ForCausalLM` (full sequence, no KV pool). Each MTP layer is one
DeepSeek-V3 decoder layer behind `eh_proj(concat(enorm(embed(t_{i+k})), hnorm(h^{k-1}_i)))`, followed by
`shared_head.norm`; `h^0` is the target's hidden after `model.norm`, `h^k` is MTP layer k's output after
`shared_head.norm` (what serving recycles). MTP layer k at row i predicts token i+k+1.

    loss = CE(target) + λ · mean_k CE(MTP_k)      λ = 0.3 for the first 70% of steps, then 0.1
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
    DeepseekV3TopkRouter,
)

LAMBDA_EARLY, LAMBDA_LATE, LAMBDA_SWITCH = 0.3, 0.1, 0.7
BIAS_UPDATE_SPEED = 1e-3  # γ of the auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2)


def mtp_lambda(step: int, total_steps: int) -> float:
    """Weight of the mean MTP loss at `step` of `total_steps`."""
    return LAMBDA_EARLY if step < LAMBDA_SWITCH * total_steps else LAMBDA_LATE


class SharedHead(nn.Module):
    """`shared_head.norm`; the head itself is the target's `lm_head`."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MTPLayer(DeepseekV3DecoderLayer):
    """One MTP module: input projection, a full decoder layer, the shared head's norm."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.enorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(
        self,
        hidden: torch.Tensor,
        token_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        rotary: DeepseekV3RotaryEmbedding,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden[B,T,H] (depth k-1), token_embeds[B,T,H] (tokens i+k) -> hidden_out[B,T,H].

        `attention_mask[1,1,T,T]` bool (True = attend); None = causal.
        """
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))  # B, T, H
        x = super().forward(x, attention_mask=attention_mask, position_ids=position_ids,
                            position_embeddings=rotary(x, position_ids))  # B, T, H
        return self.shared_head.norm(x)  # B, T, H


class TrainingModel(nn.Module):
    """The target plus its MTP layers, in one module for the optimizer."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        config._attn_implementation = "sdpa"
        self.target = DeepseekV3ForCausalLM(config)
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(config, n + i) for i in range(config.num_nextn_predict_layers))
        for module in self.mtp.modules():
            self.target._init_weights(module)

    def forward(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """tokens[B,L] -> [target logits[B,L,V], then MTP depth k logits[B,L-k,V] for k = 1..D].

        Row i of depth k (k = 0 is the target) predicts token i+k+1.
        """
        B, L = tokens.shape  # batch, window length
        base = self.target.model
        positions = torch.arange(L, device=tokens.device).unsqueeze(0)  # 1, L
        hidden = base(input_ids=tokens, position_ids=positions).last_hidden_state  # B, L, H
        logits = [self.target.lm_head(hidden)]  # B, L, V
        embeds = base.embed_tokens(tokens)  # B, L, H
        for k, layer in enumerate(self.mtp, start=1):
            n = L - k  # rows i = 0..n-1 pair h^{k-1}_i with embed(t_{i+k})
            hidden = layer(hidden[:, :n], embeds[:, k:k + n], positions[:, :n] + (k - 1), base.rotary_emb)  # B, n, H
            logits.append(self.target.lm_head(hidden))  # B, n, V
        return logits


def depth_losses(logits: list[torch.Tensor], tokens: torch.Tensor) -> list[torch.Tensor]:
    """Cross-entropy of each depth (target first) against the tokens it predicts."""
    return [_cross_entropy(lg[:, :-1], tokens[:, k + 1:]) for k, lg in enumerate(logits)]


def draft_agreement(logits: list[torch.Tensor]) -> list[float]:
    """Teacher-forced greedy acceptance per MTP depth: MTP_k's argmax at row i equals the target's at i+k."""
    target = logits[0].argmax(-1)  # B, L
    return [(lg.argmax(-1) == target[:, k:]).float().mean().item()
            for k, lg in enumerate(logits[1:], start=1)]


def objective(losses: list[torch.Tensor], weight: float) -> torch.Tensor:
    """Next-token loss (first) plus `weight` times the mean MTP loss (the rest)."""
    return losses[0] + weight * torch.stack(losses[1:]).mean()


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())  # (B*T, V), (B*T,)


class LoadBalancer:
    """Auxiliary-loss-free balancing: nudge each router's `e_score_correction_bias` toward equal load."""

    def __init__(self, model: nn.Module, speed: float = BIAS_UPDATE_SPEED):
        self.speed = speed
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = {id(r): torch.zeros_like(r.e_score_correction_bias) for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: DeepseekV3TopkRouter, _inputs, outputs) -> None:
        topk_indices = next(t for t in outputs if not t.is_floating_point())  # tokens, top_k
        load = self.loads[id(router)]  # E
        load += torch.bincount(topk_indices.flatten(), minlength=load.numel())

    @torch.no_grad()
    def update(self) -> None:
        """Apply one bias step from the loads counted since the last call, then reset them."""
        for router in self.routers:
            load = self.loads[id(router)]  # E
            router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            load.zero_()


def checkpoint_state_dict(model: TrainingModel) -> dict[str, torch.Tensor]:
    """Parameters under their DeepSeek-V3 checkpoint names: per-expert linears, MTP at layers N+i."""
    n = model.target.config.num_hidden_layers
    named = dict(model.target.state_dict())
    for i, layer in enumerate(model.mtp):
        named.update({f"model.layers.{n + i}.{k}": v for k, v in layer.state_dict().items()})
    # transformers fuses each layer's experts on load; revert to `experts.{e}.{gate,up,down}_proj.weight`
    return {k: v.detach().contiguous() for k, v in revert_weight_conversion(model.target, named).items()}
