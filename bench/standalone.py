"""The best one process does over the same checkpoint, without Triton: plain and MTP speculative greedy loops.

Batch 1, greedy, one KV slot. Plain decoding runs the target on one token per step. Speculative
decoding per step: draft k tokens with the MTP layers (draft step s uses layer s % n and recycles the
MTP's hidden state after `shared_head.norm`), verify the window [last token, drafts] with one target
call, accept with `serving.rejection.verify`, then let the MTP layers absorb the accepted tokens
paired with the target's hidden states: the same arithmetic as the serving engine's workers.

Every decode-loop call has a fixed shape: the target decodes [1, 1] and verifies [1, W], the MTP
absorbs and chains [1, W], where W = max k + 1 and unused tokens are padding (position -1 writes the
pool's scratch position). So a handful of graphs serve every k (gpt-fast style, see bench/graphs.py);
prefill runs eager. Stops at max_tokens or EOS, like the server.

    python -m bench.standalone --checkpoint DIR --out standalone.json [--device cuda --dtype bf16
        --graphs reduce-overhead --draft-tokens 1,2,3,4 --prompts 8 --prompt-tokens 128 --max-tokens 128]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from .common import (
    acceptance_summary, bench_max_seq_len, environment, held_out_prompts, latency_summary, synchronize, write_result,
)
from .graphs import MODES, place_rope, wrap_step
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.formats import DTYPES
from triton_mtp.export.moe import MOE_KINDS, default_moe_kind
from triton_mtp.export.model import DeepseekV3MTP, DeepseekV3Target
from triton_mtp.serving.rejection import verify
from triton_mtp.serving.sampling import SamplingParams, target_probs


@dataclass
class Generation:
    """One prompt's output and timings."""

    tokens: list[int]
    ttft_s: float
    total_s: float
    gaps: list[float] = field(default_factory=list)  # per step: seconds since the previous step / tokens emitted
    num_drafts: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class StandaloneDecoder:
    """Greedy plain and speculative decoding for one sequence (slot 0) with fixed-shape steps."""

    def __init__(self, target: DeepseekV3Target, mtp: DeepseekV3MTP | None, mode: str, max_draft: int,
                 eos_token_id: int | None) -> None:
        self.target, self.mtp, self.eos = target, mtp, eos_token_id
        self.width = max_draft + 1  # W: verify window and MTP call width
        self.device = target.lm_head.weight.device
        self.hidden_dtype = target.lm_head.weight.dtype
        self.num_layers = mtp.config.num_nextn_predict_layers if mtp is not None else 0
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # [1]
        self.greedy = torch.ones(1, dtype=torch.bool, device=self.device)  # [1]
        self.params = SamplingParams.from_requests([0.0], [0], [1.0], self.device)
        place_rope(target, self.device)
        if mtp is not None:
            place_rope(mtp, self.device)
        one = self._ids(1), self._positions(-1, 1), self.slot
        window = self._ids(self.width), self._positions(-1, self.width), self.slot
        self.decode = wrap_step(target, mode, one)
        self.verify_step = wrap_step(target, mode, window) if max_draft else None
        hidden = torch.zeros(1, self.width, target.config.hidden_size, dtype=self.hidden_dtype, device=self.device)
        self.mtp_steps = [
            wrap_step(mtp.layer_step(i), mode, (window[0], hidden, window[1], self.slot))
            for i in range(self.num_layers)
        ] if mtp is not None and max_draft else []

    def _ids(self, n: int) -> torch.Tensor:
        return torch.zeros(1, n, dtype=torch.long, device=self.device)  # [1, n]

    def _positions(self, start: int, valid: int, width: int | None = None) -> torch.Tensor:
        """[1, width] positions start .. start + valid - 1, then -1 padding (start -1: all padding)."""
        width = valid if width is None else width
        pos = torch.full((1, width), -1, dtype=torch.long)  # [1, width]
        if start >= 0:
            pos[0, :valid] = torch.arange(start, start + valid)
        return pos.to(self.device)

    def _padded(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        row = torch.zeros(1, self.width, dtype=torch.long, device=self.device)  # [1, W]
        ids = torch.as_tensor(ids, device=self.device).view(-1)  # [n]
        row[0, : ids.numel()] = ids
        return row

    @torch.no_grad()
    def generate(self, prompt: list[int], max_tokens: int, k: int) -> Generation:
        """Greedy decode `max_tokens` tokens after `prompt`, drafting k per step (0 = plain decoding)."""
        if k and not self.mtp_steps:
            raise ValueError("draft tokens: the checkpoint has no MTP layers (or max draft is 0)")
        if k >= self.width:
            raise ValueError(f"draft tokens: {k} exceeds the decoder's maximum {self.width - 1}")
        self.target.reset_cache()
        if self.mtp is not None:
            self.mtp.reset_cache()
        P = len(prompt)
        synchronize(self.device)
        start = time.perf_counter()
        ids = torch.tensor([prompt], device=self.device)  # [1, P]
        logits, hidden = self.target(ids, self._positions(0, P), self.slot)  # [1, P, V], [1, P, H]
        token = int(logits[0, -1].argmax())
        ttft = time.perf_counter() - start
        out = Generation([], ttft, 0.0, accepted_per_position=[0] * k)
        done = self._emit(out, [token], max_tokens)
        if k and not done:
            pairs = torch.tensor([prompt[1:] + [token]], device=self.device)  # [1, P]
            draft_logits, draft_hidden = self._absorb_prefill(pairs, hidden)  # [V], [H]
        pos, last = P, time.perf_counter()  # pos: position of `token`, not yet in the target's pool
        while not done:
            k_step = min(k, max_tokens - len(out.tokens) - 1)
            if k_step == 0:
                logits, _ = self.decode(self._ids(1) + token, self._positions(pos, 1), self.slot)  # [1, 1, V]
                emitted = [int(logits[0, 0].argmax())]
            else:
                emitted, draft_logits, draft_hidden = self._speculate(token, pos, k_step, draft_logits, draft_hidden, out)
            now = time.perf_counter()
            out.gaps.append((now - last) / len(emitted))
            last = now
            done = self._emit(out, emitted, max_tokens)
            token, pos = emitted[-1], pos + len(emitted)
        out.total_s = time.perf_counter() - start
        return out

    def _emit(self, out: Generation, ids: list[int], max_tokens: int) -> bool:
        """Append ids until EOS (not emitted, as in the server) or max_tokens; True when the sequence ended."""
        for t in ids:
            if t == self.eos:
                return True
            out.tokens.append(t)
            if len(out.tokens) == max_tokens:
                return True
        return False

    def _absorb_prefill(self, pairs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layers over the shifted prompt (eager); layer 0's last row gives draft 1."""
        positions = self._positions(0, pairs.shape[1])  # [1, P]
        for layer in range(self.num_layers - 1, -1, -1):
            logits, out = self.mtp(pairs, hidden, positions, self.slot, layer)  # [1, P, V], [1, P, H]
        return logits[0, -1], out[0, -1]

    def _speculate(self, token: int, pos: int, k: int, draft_logits: torch.Tensor, draft_hidden: torch.Tensor,
                   out: Generation) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Draft k, verify, accept; absorb the accepted pairs. Returns emitted ids and the next draft-1 state."""
        W, H = self.width, draft_hidden.shape[-1]
        drafts = [draft_logits.argmax()]  # d_1 predicts position pos + 1
        chain_tokens, chain_hidden = [], []  # pairs (d_s, h) at positions pos, pos + 1, ...
        written = [0] * self.num_layers
        for s in range(1, k):
            chain_tokens.append(drafts[-1])
            chain_hidden.append(draft_hidden)
            layer = s % self.num_layers
            first = written[layer]
            n = s - first  # chain pairs this layer has not seen
            hidden = torch.zeros(1, W, H, dtype=self.hidden_dtype, device=self.device)  # [1, W, H]
            hidden[0, :n] = torch.stack(chain_hidden[first:])  # [n, H]
            logits, hid = self.mtp_steps[layer](
                self._padded(torch.stack(chain_tokens[first:])), hidden, self._positions(pos + first, n, W), self.slot
            )  # [1, W, V], [1, W, H]
            drafts.append(logits[0, n - 1].argmax())
            draft_hidden = hid[0, n - 1].clone()
            written[layer] = s
        draft_ids = torch.stack(drafts).view(1, k)  # [1, k]
        window = torch.cat([torch.tensor([token], device=self.device), draft_ids[0]])  # [k + 1]
        logits, hidden = self.verify_step(self._padded(window), self._positions(pos, k + 1, W), self.slot)  # [1, W, V], [1, W, H]
        probs = target_probs(logits[:, : k + 1], self.params)  # [1, k + 1, V]
        num_draft = torch.full((1,), k, dtype=torch.long, device=self.device)  # [1]
        _, output_ids = verify(probs, draft_ids, None, num_draft, self.greedy, [None])  # [1], [1, k + 1]
        ids = output_ids[0].tolist()
        a = sum(1 for t in ids if t >= 0) - 1  # accepted drafts
        out.num_drafts += 1
        out.accepted += a
        for j in range(a):
            out.accepted_per_position[j] += 1
        # MTP pairs (t_{i+1}, h_i) for i = pos .. pos + a: emitted tokens with the window's hidden states.
        pair_hidden = torch.zeros(1, W, H, dtype=self.hidden_dtype, device=self.device)  # [1, W, H]
        pair_hidden[0, : a + 1] = hidden[0, : a + 1].to(self.hidden_dtype)
        pairs, positions = self._padded(ids[: a + 1]), self._positions(pos, a + 1, W)
        for layer in range(self.num_layers - 1, -1, -1):
            m_logits, m_hidden = self.mtp_steps[layer](pairs, pair_hidden, positions, self.slot)  # [1, W, V], [1, W, H]
        return ids[: a + 1], m_logits[0, a].clone(), m_hidden[0, a].clone()


def summarize(runs: list[Generation], k: int) -> dict:
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.total_s for r in runs)
    drafts, accepted = sum(r.num_drafts for r in runs), sum(r.accepted for r in runs)
    per_position = [sum(r.accepted_per_position[j] for r in runs) for j in range(k)]
    result = {
        "num_draft_tokens": k, "requests": len(runs), "output_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft": latency_summary([r.ttft_s for r in runs]),
        "itl": latency_summary([g for r in runs for g in r.gaps]),
        "outputs": [r.tokens for r in runs],
    }
    if k:
        result.update(acceptance_summary(per_position, drafts, accepted))
    return result


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    prompts = held_out_prompts(args.checkpoint, args.prompts, args.prompt_tokens)
    draft_counts = [int(k) for k in args.draft_tokens.split(",") if k] if args.draft_tokens else []
    max_draft = max(draft_counts, default=0)
    max_seq_len = bench_max_seq_len(args.prompt_tokens, args.max_tokens, max_draft)
    moe = args.moe or default_moe_kind(device, DTYPES[args.dtype])
    config, target, mtp = load_checkpoint(args.checkpoint, args.dtype, device, max_slots=1,
                                          max_seq_len=max_seq_len, progress=False, moe=moe)
    if mtp is None:
        draft_counts, max_draft = [], 0
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else None
    decoder = StandaloneDecoder(target, mtp, args.graphs, max_draft, eos)
    results = {"benchmark": "standalone", "graphs": args.graphs, "dtype": args.dtype, "device": str(device), "moe": moe,
               "prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "environment": environment(), "runs": {}}
    for k in [0, *draft_counts]:
        decoder.generate(prompts[0], min(args.max_tokens, 8), k)  # warm-up: compiles / captures
        runs = [decoder.generate(p, args.max_tokens, k) for p in prompts]
        results["runs"][str(k)] = summarize(runs, k)
        if k:
            results["runs"][str(k)]["same_tokens_as_plain"] = [r.tokens for r in runs] == results["runs"]["0"]["outputs"]
        print(f"standalone k={k}: {results['runs'][str(k)]['tokens_per_s']:.1f} tokens/s", flush=True)
        write_result(args.out, results)  # what is done so far survives a time limit
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json, safetensors)")
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--graphs", default="reduce-overhead", choices=MODES)
    parser.add_argument("--draft-tokens", default="1,2,3,4", help="comma-separated k values besides plain")
    parser.add_argument("--moe", choices=MOE_KINDS, help="routed experts (export/moe.py; default as the eager export)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
