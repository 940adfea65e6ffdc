"""Whether chained steps replayed from `graphs.GraphedChain` emit what the engine emits without it.

The scheduler runs in process, greedy, over three sets of workers: eager, the decode graphs without the
chain graph (a chained step drafts through `GraphedDraftChain` and the ops around it), and the decode
graphs with it, each checked against eager first as the served models check them. Requests join and finish
at different steps, with k mixed across requests and with drafting off above two rows in one case. For each
case it reports whether every request's tokens and draft statistics agree across the three, and how many
chained calls replayed the chain graph. On CPU the graphs are `EagerReplay` stand-ins (what the tests do);
the capture is checked on a GPU. Exit status 1 when any output differs.

    python -m bench.chain_check --checkpoint models/tiny-dsv3-mtp [--device cuda --out chain_check.json]
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch

from .common import environment, write_result
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.serving import graphs
from triton_mtp.serving.requests import GenerationRequest, in_process_limits
from triton_mtp.serving.scheduler import FinalResponse, Scheduler
from triton_mtp.serving.workers import DraftWorker, InProcessHops, TargetWorker, verify_window

SLOTS, MAX_DRAFT, MAX_SEQ_LEN, REQUESTS = 4, 3, 256, 7
CASES = (([3], 0), ([1, 2, 3], 0), ([3, 2], 2), ([2], 0))  # (k per request, in turn; spec_disable_rows)
MODES = ("eager", "graphed", "chain graphed")


class _CountedChain:
    """The chain graph, counting the chained calls it replays."""

    def __init__(self, chain: graphs.GraphedChain) -> None:
        self.chain, self.replays = chain, 0
        self.covers = chain.covers

    def __call__(self, B: int, K: int):
        self.replays += 1
        return self.chain(B, K)


def run(checkpoint: str, device: torch.device, mode: str, draft_counts: list[int], spec_disable_rows: int,
        seed: int) -> tuple[list, int | None]:
    """Each request's (output ids, accepted drafts, drafts) and the chain graph's replays (None without it)."""
    config, target, mtp = load_checkpoint(checkpoint, device=device, max_slots=SLOTS, max_seq_len=MAX_SEQ_LEN,
                                          progress=False)
    layers, hidden = config.num_nextn_predict_layers, config.hidden_size
    window, mtp_step, greedy, chained = verify_window(target), mtp, None, None
    if mode != "eager":
        graph = graphs.CapturedStep if device.type == "cuda" else graphs.EagerReplay
        checked = functools.partial(graphs.with_decode_graphs, step=None, log=print)
        window = checked(lambda: graphs.target_graphs(target, SLOTS, MAX_DRAFT, device, graph))
        mtp_step = checked(lambda: graphs.mtp_graphs(mtp, layers, SLOTS, MAX_DRAFT, hidden, torch.float32, device, graph))
        greedy = checked(lambda: graphs.draft_chain_graphs(mtp, mtp_step, MAX_DRAFT, graph))
        if None in (window, mtp_step, greedy):
            raise RuntimeError("a decode graph disagreed with eager (logged above)")
        if mode == "chain graphed":
            chained = checked(lambda: graphs.chain_graphs(window, mtp, mtp_step, graph))
            if chained is None:
                raise RuntimeError("the chain graph disagreed with eager (logged above)")
            chained = _CountedChain(chained)
    hops = InProcessHops(TargetWorker(window, SLOTS, device),
                         DraftWorker(mtp_step, layers, SLOTS, device, torch.float32, greedy=greedy), chained)
    limits = in_process_limits(config.vocab_size, SLOTS, MAX_SEQ_LEN, MAX_DRAFT, REQUESTS)
    engine = Scheduler(hops, limits, spec_disable_rows=spec_disable_rows)
    generator = torch.Generator().manual_seed(seed)
    handles = [FinalResponse() for _ in range(REQUESTS)]
    for n, handle in enumerate(handles):
        prompt = torch.randint(2, config.vocab_size, (3 + 5 * n,), generator=generator).tolist()
        engine.submit(GenerationRequest(input_ids=prompt, max_tokens=9 + 13 * n,
                                        num_draft_tokens=draft_counts[n % len(draft_counts)]), handle)
    engine.run_until_idle()
    failed = [h.error for h in handles if h.final is None]
    if failed:
        raise RuntimeError(f"{mode}: a request failed: {failed[0]}")
    outputs = [(h.final.output_ids, h.final.total_accepted_draft_tokens, h.final.total_draft_tokens)
               for h in handles]
    return outputs, chained.replays if chained is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="result JSON file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases, agree = [], True
    for seed, (draft_counts, spec_disable_rows) in enumerate(CASES, 1):
        runs = {mode: run(args.checkpoint, device, mode, draft_counts, spec_disable_rows, seed) for mode in MODES}
        same = all(runs[mode][0] == runs["eager"][0] for mode in MODES)
        agree &= same
        cases.append({"draft_tokens": draft_counts, "spec_disable_rows": spec_disable_rows, "agree": same,
                      "chain_replays": runs["chain graphed"][1],
                      "accepted_of_drafted": [[a, d] for _, a, d in runs["eager"][0]]})
        print(f"k {draft_counts}, spec_disable_rows {spec_disable_rows}: outputs "
              f"{'agree' if same else 'DIFFER'}, {runs['chain graphed'][1]} chained calls replayed the chain graph")
    if args.out:
        write_result(args.out, {"benchmark": "chain_check", "device": str(device), "cases": cases,
                                "environment": environment()})
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
