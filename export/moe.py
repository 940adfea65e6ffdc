"""Dense MLP and DeepSeek-V3 mixture of experts (sigmoid scores, noaux_tc group-limited top-k).

The routed experts run one of two ways (`MOE_KINDS`):

- dense: every routed expert runs on every token, weighted by its routing weight (zero when not
  selected). Free of data-dependent shapes, so every export format takes it, and cheap enough for
  the small models this runs on CPU. A decode step reads all E experts' weights.
- grouped (`MoE.group_experts`): the experts' weights are stacked into w13[E, 2I, H] (gate ‖ up) and
  w2[E, H, I], and the routed part is two `torch.nn.functional.grouped_mm` calls over the tokens'
  top-k picks sorted by expert. An expert no token picked is a group of zero rows and its weights
  are not read: a decode step reads K of E experts. The group offsets stay on the device (no host
  sync), so a step captures in a CUDA graph where grouped_mm runs natively (bf16 on CUDA sm90+). The
  CPU build runs it for fp32 and bf16 too, but the default there stays dense; torch.compile takes it in
  bf16 only (its meta kernel checks the dtype), so compiled steps need bf16. Under expert
  parallelism a rank holds E/W experts and takes K picks among them, so picks with zero weight may
  read experts no token chose; the sum is the same. Where the picks are few (a decode step: no more than
  the experts, or few bytes of them) and Triton runs (CUDA), the routed part is instead two kernels that
  read each pick's expert in place (export/fused_moe.py): no sort, gather or offsets. Where Triton runs,
  the routing after the gate's linear is one kernel too, for every call.

Grouping also folds the shared experts into the stack where their intermediate size is a multiple of the
routed experts' (always, unless tensor parallelism split it otherwise): SwiGLU splits over its intermediate
columns, so a shared MLP of S·I columns is S experts of I that every token picks with weight 1, appended
after the routed ones. They run in the same grouped GEMMs or kernels as the routed picks and need no GEMMs,
activation or add of their own; the sum differs from the separate MLP's only in rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from triton_mtp.export import fused_moe
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.linear import Linear, decode_linear

MOE_KINDS = ("grouped", "dense")


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Router: sigmoid scores; `e_score_correction_bias` steers the selection only, not the weights.
    With `decode_kernel` True a decode call's logits take export/linear.py's kernel where it runs. False by default
    until measured on a GPU (bench/decode_kernels.py's router shapes): `export --decode-kernels` names it
    (export/kernel_choice.py), and bench/realistic.py's grouped variants other than fused-cublas turn it on."""

    decode_kernel = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def hold_float32(self) -> None:
        """Keep the weight and the bias in float32, as `logits` and `route` use them: no conversion per call."""
        self.weight = nn.Parameter(self.weight.float(), requires_grad=self.weight.requires_grad)
        self.e_score_correction_bias = self.e_score_correction_bias.float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x[N, H] -> the router's logits [N, E] float32 (before the sigmoid). With `decode_kernel`, a decode call
        takes export/linear.py's kernel where it runs: one launch where cuBLAS's float32 GEMV took two (run 37),
        though over only E / BLOCK_N programs."""
        if self.decode_kernel and fused_moe.runs_on(x.device):
            return decode_linear(x.float(), self.weight.float())
        return F.linear(x.float(), self.weight.float())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x[N, H] -> (routing weights [N, K] float32, expert ids [N, K]) of each token's top-k experts."""
        N = x.shape[0]
        scores = self.logits(x).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()  # [N, E]
        if self.topk_group < self.n_group:  # keep the experts of the best topk_group groups
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
        return top_w * self.scaling, top_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[N, H] -> dense routing weights [N, E] float32, zero for unselected experts."""
        top_w, top_idx = self.route(x)  # [N, K] each
        return top_w.new_zeros(x.shape[0], self.num_experts).scatter(1, top_idx, top_w)  # [N, E]


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
        self.register_parameter("w13", None)  # [E + S, 2I, H] once grouped
        self.register_parameter("w2", None)  # [E + S, H, I] once grouped
        self.shared_in_stack = 0  # S: shared experts folded into w13 / w2's last rows
        self.first_expert = 0  # of the experts held here (expert parallelism: export/parallel.py)
        # grouped, where export/fused_moe.py's kernels run: every call routes through its kernel, and calls
        # of few tokens run their experts through its two others
        self.fused_decode = True

    @property
    def grouped(self) -> bool:
        return self.w13 is not None

    def group_experts(self) -> None:
        """Stack the experts' weights into w13 / w2, with the shared experts last where they split into
        routed-sized experts, and drop the per-expert modules (idempotent). One copy of the weights."""
        if self.grouped:
            return
        shared = self._shared_as_experts(self.experts[0].down_proj.in_features)  # ([S, 2I, H], [S, H, I]) or None
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts]
                              + (list(shared[0]) if shared else []))  # [E + S, 2I, H]
            w2 = torch.stack([e.down_proj.weight for e in self.experts]
                             + (list(shared[1]) if shared else []))  # [E + S, H, I]
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        del self.experts
        if shared:
            self.shared_in_stack, self.shared_experts = shared[1].shape[0], None
        self.gate.hold_float32()
        fused_moe.load_kernels()

    @property
    def routed_in_stack(self) -> int:
        """The routed experts held in w13 / w2 (all, or this rank's under expert parallelism)."""
        return self.w13.shape[0] - self.shared_in_stack

    def kernel_tokens(self) -> int:
        """The most tokens a call runs through export/fused_moe.py's expert kernels (`fused_moe.max_tokens`)."""
        return fused_moe.max_tokens(self.gate.top_k + self.shared_in_stack, self.w13, self.w2)

    def _shared_as_experts(self, inter: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared MLP [S·I] as S experts of `inter` = I (gate ‖ up [S, 2I, H], down [S, H, I]), or None
        where there is none or I does not divide its intermediate size. Expert s is its columns [sI, sI + I)."""
        shared = self.shared_experts
        if shared is None or shared.down_proj.in_features % inter:
            return None
        S, H = shared.down_proj.in_features // inter, shared.down_proj.out_features
        gate = shared.gate_proj.weight.reshape(S, inter, H)  # [S, I, H]
        up = shared.up_proj.weight.reshape(S, inter, H)  # [S, I, H]
        return torch.cat([gate, up], dim=1), shared.down_proj.weight.reshape(H, S, inter).transpose(0, 1)

    def fold_shared_experts(self) -> None:
        """Append the shared MLP to the grouped stack as S experts (`_shared_as_experts`), where it splits."""
        shared = self._shared_as_experts(self.w2.shape[-1])
        if shared is None:
            return
        with torch.no_grad():
            self.w13 = nn.Parameter(torch.cat([self.w13, shared[0]]), requires_grad=False)  # [E + S, 2I, H]
            self.w2 = nn.Parameter(torch.cat([self.w2, shared[1]]), requires_grad=False)  # [E + S, H, I]
        self.shared_in_stack, self.shared_experts = shared[1].shape[0], None

    def unfold_shared_experts(self) -> None:
        """The shared MLP back out of the grouped stack (`fold_shared_experts` undone). The routed stack
        stays a view of the folded one until it is replaced (export/parallel.py slices it)."""
        S = self.shared_in_stack
        if not S:
            return
        E, (_, H, inter) = self.routed_in_stack, self.w2.shape
        with torch.device("meta"):
            shared = MLP(H, S * inter)
        gate, up = self.w13[E:].chunk(2, dim=1)  # [S, I, H] each
        for linear, weight in ((shared.gate_proj, gate.reshape(S * inter, H)),
                               (shared.up_proj, up.reshape(S * inter, H)),
                               (shared.down_proj, self.w2[E:].transpose(0, 1).reshape(H, S * inter))):
            linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.w13 = nn.Parameter(self.w13[:E], requires_grad=False)  # [E, 2I, H]
        self.w2 = nn.Parameter(self.w2[:E], requires_grad=False)  # [E, H, I]
        self.shared_experts, self.shared_in_stack = shared, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        routed = self._grouped(flat) if self.grouped else self._dense(flat)  # [N, H] f32
        out = routed.to(x.dtype).view(shape)  # [..., H]
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def _dense(self, flat: torch.Tensor) -> torch.Tensor:
        weights = self.gate(flat)  # [N, E] (the held experts' columns under expert parallelism)
        routed = torch.zeros_like(flat, dtype=torch.float32)  # [N, H]
        for e, expert in enumerate(self.experts):
            routed = routed + expert(flat).float() * weights[:, e : e + 1]  # [N, H]
        return routed

    def _grouped(self, flat: torch.Tensor) -> torch.Tensor:
        kernels = self.fused_decode and fused_moe.runs_on(flat.device)
        top_w, top_idx = fused_moe.route(self.gate, flat) if kernels else self.gate.route(flat)  # [N, K] each
        E, S = self.routed_in_stack, self.shared_in_stack
        if E < self.gate.num_experts:  # expert parallel: picks of other ranks' experts weigh zero here
            local = top_idx - self.first_expert  # [N, K]
            top_w, top_idx = top_w * ((local >= 0) & (local < E)), local.clamp(0, E - 1)  # [N, K] each
        if kernels:
            picked = routed_experts(flat, self.w13, self.w2, top_w, top_idx, S, self.kernel_tokens())  # [N, K+S, H]
        else:
            picked = grouped_gemm_experts(flat, self.w13, self.w2, top_w, top_idx, S)  # [N, K+S, H]
        # The sum over the picks outside the op, where the compiled step fuses it with the cast and the residual
        # add; deterministic, unlike atomic index_add.
        return picked.sum(1)  # [N, H]


def grouped_gemm_experts(flat: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_w: torch.Tensor,
                         top_idx: torch.Tensor, shared: int) -> torch.Tensor:
    """The grouped GEMMs: flat[N, H] through experts w13[E + S, 2I, H], w2[E + S, H, I] at picks top_idx[N, K]
    (local ids) weighted top_w[N, K], plus the last `shared` (S) experts at weight 1 -> each pick's weighted
    output [N, K + S, H] float32, in (token, pick) order."""
    (N, K), S = top_idx.shape, shared
    E = w13.shape[0] - S
    if S:  # every token also picks the shared experts, weight 1
        shared_idx = torch.arange(E, E + S, device=flat.device).expand(N, S)  # [N, S]
        top_idx, top_w = torch.cat([top_idx, shared_idx], 1), torch.cat([top_w, top_w.new_ones(N, S)], 1)  # [N, K+S]
    picks = K + S
    experts = top_idx.reshape(-1)  # [N*picks]
    order = experts.argsort(stable=True)  # [N*picks] (token, pick) pairs grouped by expert
    xs = flat.index_select(0, order // picks)  # [N*picks, H]
    # bincount would size its output from experts.max() on the host: a sync that breaks graph capture.
    counts = torch.zeros(E + S, dtype=torch.int32, device=flat.device).scatter_add_(
        0, experts, torch.ones_like(experts, dtype=torch.int32))  # [E+S] pairs per expert
    offs = counts.cumsum(0, dtype=torch.int32)  # [E+S] end of each expert's rows
    gate, up = F.grouped_mm(xs, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)  # [N*picks, I] each
    ys = F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)  # [N*picks, H]
    weighted = ys.float() * top_w.reshape(-1).index_select(0, order).unsqueeze(-1)  # [N*picks, H]
    return torch.empty_like(weighted).index_copy_(0, order, weighted).view(N, picks, -1)  # [N, K+S, H]


# One opaque op for the dispatch where the kernels run: a compiled step (dynamic shapes) would otherwise guard
# on `tokens <= kernel_tokens` and compile each size class twice, once on each side of the bound, variants the
# export's shipped cache did not hold (bench/warm_up.py). Each CUDA graph still replays one path: its tokens are
# fixed at capture. The price: past the bound the grouped GEMMs run eagerly here, 8% more a V2-Lite layer at 16
# and 64 tokens than compiled with the step (docs/benchmarks.md, run 37).
@torch.library.custom_op("triton_mtp::routed_experts", mutates_args=())
def routed_experts(flat: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_w: torch.Tensor,
                   top_idx: torch.Tensor, shared: int, kernel_tokens: int) -> torch.Tensor:
    """`grouped_gemm_experts`, through export/fused_moe.py's kernels for calls of at most `kernel_tokens` tokens."""
    if flat.shape[0] <= kernel_tokens:
        return fused_moe.fused_experts(flat, w13, w2, top_w, top_idx, shared)  # [N, K+S, H]
    return grouped_gemm_experts(flat, w13, w2, top_w, top_idx, shared)  # [N, K+S, H]


@routed_experts.register_fake
def _(flat: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_w: torch.Tensor, top_idx: torch.Tensor,
      shared: int, kernel_tokens: int) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], top_idx.shape[1] + shared, w2.shape[1], dtype=torch.float32)  # [N, K+S, H]


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` runs natively for this device and dtype (a probe call). On CUDA it needs
    sm90+: older GPUs run a fallback that copies the offsets to the host, which no graph captures."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        a = torch.ones(2, 16, dtype=dtype, device=device)  # [2, 16]
        b = torch.ones(2, 16, 16, dtype=dtype, device=device).transpose(-2, -1)  # [2, 16, 16]
        F.grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def default_moe_kind(device: torch.device, dtype: torch.dtype) -> str:
    """grouped on CUDA where grouped_mm runs natively, else dense."""
    return "grouped" if device.type == "cuda" and grouped_mm_works(device, dtype) else "dense"

