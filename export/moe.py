"""Dense MLP and DeepSeek-V3 mixture of experts (sigmoid scores, noaux_tc group-limited top-k).

Every routed expert runs on every token and is weighted by its routing weight (zero when not selected):
exact, free of data-dependent shapes, and cheap enough for the small models this runs on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_mtp.export.config import ModelConfig


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Router: sigmoid scores; `e_score_correction_bias` steers the selection only, not the weights."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[N, H] -> dense routing weights [N, E] float32, zero for unselected experts."""
        N = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()  # [N, E]
        grouped = choice.view(N, self.n_group, self.num_experts // self.n_group)  # [N, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        group_idx = group_scores.topk(self.topk_group, dim=-1).indices  # [N, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)  # [N, G]
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(N, self.num_experts)  # [N, E]
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))  # [N, E]
        top_idx = choice.topk(self.top_k, dim=-1).indices  # [N, K]
        top_w = scores.gather(1, top_idx)  # [N, K]
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)  # [N, K]
        return torch.zeros_like(scores).scatter(1, top_idx, top_w * self.scaling)  # [N, E]


class MoE(nn.Module):
    """Routed experts weighted by the gate, plus the always-on shared experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Gate(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        weights = self.gate(flat)  # [N, E]
        routed = torch.zeros_like(flat, dtype=torch.float32)  # [N, H]
        for e, expert in enumerate(self.experts):
            routed = routed + expert(flat).float() * weights[:, e : e + 1]  # [N, H]
        out = routed.to(x.dtype).view(shape)  # [..., H]
        return out if self.shared_experts is None else out + self.shared_experts(x)
