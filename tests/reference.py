"""Reference decoding loops the served paths are compared against."""
from __future__ import annotations

import torch


def greedy_completion(target, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding with an eager target in slot 0, one token per step."""
    target.reset_cache()
    slot_ids = torch.tensor([0])  # [1]
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt]), torch.arange(len(prompt))[None], slot_ids)  # [1, T, V]
        out: list[int] = []
        for _ in range(max_tokens):
            out.append(int(logits[0, -1].argmax()))
            position = len(prompt) + len(out) - 1
            logits, _ = target(torch.tensor([[out[-1]]]), torch.tensor([[position]]), slot_ids)  # [1, 1, V]
    return out
