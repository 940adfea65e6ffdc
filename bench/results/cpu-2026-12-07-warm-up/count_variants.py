"""Compiled variants of the bundled model's target and MTP over the shapes its decode graphs capture, with the
MoE's decode kernels taken as on a GPU but their calls stubbed by torch ops of their shape (the interpreter does
not trace under dynamo; `tests/test_fused_moe.py`'s guard test does the same for one layer). bf16, grouped MoE,
one counting backend for every step, as the served steps' inductor backends compare equal.

    python count_variants.py [--per-pick]   # --per-pick: fused_experts returns [N, K+S, H] (from 401060f on)
"""
import json
import sys

import torch

from triton_mtp.export import fused_moe
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.formats.eager import raise_recompile_limit

per_pick = "--per-pick" in sys.argv
fused_moe.runs_on = lambda device: True
fused_moe.route = lambda gate, x: gate.route(x)
fused_moe.fused_experts = lambda x, w13, w2, top_w, top_idx, shared: (
    x.float()[:, None].expand(-1, top_idx.shape[1] + shared, -1) if per_pick else x.float())
raise_recompile_limit()
config, target, mtp = load_checkpoint("models/tiny-dsv3-mtp", torch.bfloat16, "cpu", 64, 512, progress=False,
                                      moe="grouped")
buckets = [1, 2, 4, 8, 16, 32, 64]
graphs = []


def backend(gm, inputs):
    graphs.append(gm)
    return gm.forward


def count(step, shapes, hidden: bool) -> int:
    before = len(graphs)
    compiled = torch.compile(step, dynamic=True, backend=backend)
    with torch.no_grad():
        for B, T in shapes:
            inputs = [torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1), torch.zeros(B, dtype=torch.long)]
            if hidden:
                inputs.insert(1, torch.zeros(B, T, config.hidden_size, dtype=torch.bfloat16))
            compiled(*inputs)
    return len(graphs) - before


target_shapes = ([(B, T) for B in buckets for T in (1, 5)] + [(1, 37), (1, 200)]
                 + [(b, w) for w in (16, 32, 64, 128, 256) for b in buckets if b * w <= 256])
mtp_shapes = [(B, T) for B in buckets for T in (1, 6)] + [(1, 37), (1, 200)]
result = {"kernel_tokens": next(m.kernel_tokens() for m in target.modules() if hasattr(m, "kernel_tokens")),
          "target": count(target, target_shapes, False),
          "mtp": sum(count(mtp.layer_step(k), mtp_shapes, True) for k in range(config.num_nextn_predict_layers))}
print(json.dumps(result))
