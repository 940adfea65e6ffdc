"""Where an engine step's time goes, without Triton: the model calls against everything else.

Runs the continuous-batching engine in process (`InProcessHops`: the same workers `target` and `mtp`
run in the server) over held-out prompts of the checkpoint, greedy, and times the two calls of a step:
the target with greedy verification (`verify_window`) and the drafting chain (`draft_chain`). The
rest of a step is the engine's own work: building batches, moving them, emitting.
That rest is paid on every step whatever the device, so it bounds the step once the model calls are
captured graphs.

    python -m bench.engine_overhead --checkpoint models/tiny-dsv3-mtp [--device cpu --prompts 4 \\
        --prompt-tokens 64 --max-tokens 64 --draft-tokens 0,3 --out overhead.json]

--graphs (CUDA) wraps the worker calls in the decode graphs the served models replay
(`serving.graphs.GraphedTarget` / `GraphedMTP` / `GraphedDraftChain`); --compile puts the model steps
through torch.compile first (inside the graphs, with --graphs); --overlap lets plain steps launch the
next step's target call before reading their own, and greedy speculative steps draft the next window on
the device in the same launch (chained), launched ahead likewise (the scheduler's `overlap`; the model
calls are then not timed apart, they run while the engine works); --thread steps on a second thread, as the served
scheduler does (bench/cpu_threads.py: MKL is slower there); --profile FILE writes torch.profiler's table
of the ops of the last k's run, by self CPU time: what the host spends per step besides the replays.

--null-replays (with --graphs, any device) replaces each decode graph by a replay that returns the outputs of
its capture without running anything: steps then cost only the host's work (the engine, the workers' moves
and the graphs' input copies), which bounds a step whose graphs run faster than the host launches them.
Every row then emits the same tokens and drafts are never accepted, so only k = 0 is a served step's host
work; on CPU it measures that work without a GPU. The first step (the prefill, eager) runs untimed.

    python -m bench.engine_overhead --checkpoint models/tiny-dsv3-mtp --graphs --null-replays --prompts 1 \
        --max-tokens 400 --draft-tokens 0,0,0

--gil-threads N runs N Python threads that hold the GIL 50 us of every 200 while the steps run, standing in
for the served process's response threads: each torch call the engine makes lets go of the GIL, and taking it
back waits for them (--switch-interval-us sets sys.setswitchinterval, as spec_decode's switch_interval_us does).

--stream N streams the requests as served ones are: the checkpoint's tokenizer detokenizes every row's
tokens, and a response per N tokens is built and converted to the arrays the server sends.

--requests-per-prompt N makes each prompt a closed-loop stream, as bench/triton_bench.py's clients are: its
next request is submitted when the previous one's final response is sent, N in all (the first one of stream i
of S asks for (i + 1) / S of --max-tokens, so the streams' requests end at different steps, as served streams
drift apart), so requests arrive while others decode. With --null-replays, prompts replay null prompt graphs
too (`prefill_graph_tokens`: four prompts a call), so every step after the first costs the host's work alone.
The result counts the target calls launched before the previous one was read (`calls_ahead`: overlapped).

    python -m bench.engine_overhead --checkpoint models/tiny-dsv3-mtp --graphs --null-replays --overlap \
        --prompts 32 --prompt-tokens 128 --max-tokens 128 --requests-per-prompt 4 --draft-tokens 0 --stream 4
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.formats import DTYPES
from triton_mtp.export.formats.eager import compile_step
from triton_mtp.export.moe import MOE_KINDS, default_moe_kind
from triton_mtp.serving import graphs
from triton_mtp.serving.requests import GenerationRequest, TokenizerFile, in_process_limits
from triton_mtp.serving.scheduler import Scheduler
from triton_mtp.serving.workers import DraftWorker, InProcessHops, TargetWorker, draft_chain, verify_window
from triton_mtp.train.acceptance import held_out_prompts

from .common import environment, synchronize, write_result


class NullReplay(graphs.EagerReplay):
    """A decode graph that runs its step once, at capture, and returns those outputs on every replay."""

    def __init__(self, step, example_inputs, pool=None) -> None:
        super().__init__(step, example_inputs, pool)
        self.outputs = super().replay()

    def replay(self) -> tuple[torch.Tensor, ...]:
        return self.outputs


class TimedStep:
    """A model step that adds its wall time (device synchronized) to `seconds`; untimed with `timed` false."""

    def __init__(self, step, device: torch.device, timed: bool = True) -> None:
        self.step, self.device, self.seconds, self.timed = step, device, 0.0, timed
        if hasattr(step, "place"):  # the graphed target's: where its inputs go (untimed, as batches move)
            self.place = step.place

    def __call__(self, *inputs):
        if not self.timed:
            return self.step(*inputs)
        synchronize(self.device)
        start = time.perf_counter()
        out = self.step(*inputs)
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return out


@contextlib.contextmanager
def gil_contention(threads: int, busy_us: float = 50.0, idle_us: float = 150.0):
    """`threads` Python threads that each run bytecode (holding the GIL) for busy_us out of every busy_us +
    idle_us, as the served process's response threads and request parsing do while the engine steps: each
    torch call the engine makes lets go of the GIL, and getting it back then waits (served_profile, run 26)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_us * 1e-6
            while time.perf_counter() < end:
                pass
            time.sleep(idle_us * 1e-6)

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(threads)]
    for thread in spinners:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in spinners:
            thread.join()


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    tokenizer = TokenizerFile(Path(args.checkpoint) / "tokenizer.json")
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_tokens)
    draft_counts = [int(k) for k in args.draft_tokens.split(",")]
    max_seq_len = args.prompt_tokens + args.max_tokens + max(draft_counts) + 1
    moe = args.moe or default_moe_kind(device, DTYPES[args.dtype])
    max_slots = args.max_slots or len(prompts)
    config, target, mtp = load_checkpoint(args.checkpoint, args.dtype, device, max_slots=max_slots,
                                          max_seq_len=max_seq_len, progress=False, moe=moe)
    limits = in_process_limits(config.vocab_size, max_slots, max_seq_len, max(draft_counts), len(prompts))
    dtype, layers = target.lm_head.weight.dtype, config.num_nextn_predict_layers
    if args.compile:  # as the eager format loads its steps
        target, mtp = compile_step(target), compile_step(mtp)
    window, mtp_step, chained, multi_step = verify_window(target), mtp, None, None
    chain = functools.partial(draft_chain, mtp, layers)
    if args.graphs:  # as the served models wrap their steps
        max_draft = max(draft_counts)
        graph = NullReplay if args.null_replays else graphs.CapturedStep
        arriving = args.null_replays and args.requests_per_prompt > 1  # prompts mid-run: null too, four a call
        window = graphs.target_graphs(target, len(prompts), max_draft, device, graph,
                                      prefill_tokens=4 << (args.prompt_tokens - 1).bit_length() if arriving else 0)
        mtp_step = graphs.mtp_graphs(mtp, layers, len(prompts), max_draft, config.hidden_size, dtype, device, graph)
        chain = graphs.draft_chain_graphs(mtp, mtp_step, max_draft, graph)
        if args.overlap and not args.no_chain_graph:  # (a chained step's drafting is then in it, not timed apart)
            chained = graphs.chain_graphs(window, mtp, mtp_step, graph)
        if args.decode_steps > 1:
            multi_step = graphs.steps_graphs(window, target, args.decode_steps, graph)
    # greedy: every MTP call is in the chain
    timed_target, timed_mtp = TimedStep(window, device, not args.overlap), TimedStep(chain, device, not args.overlap)
    timed_steps = TimedStep(multi_step, device, not args.overlap) if multi_step else None  # eager: over timed_target
    hops = InProcessHops(TargetWorker(timed_target, len(prompts), device, args.decode_steps, timed_steps),
                         DraftWorker(mtp_step, layers, len(prompts), device, dtype, greedy=timed_mtp), chained)
    results = {"benchmark": "engine_overhead", "device": str(device), "dtype": args.dtype, "prompts": len(prompts),
               "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "graphs": args.graphs,
               "max_slots": max_slots, "compile": args.compile, "null_replays": args.null_replays, "thread": args.thread, "moe": moe,
               "spec_disable_rows": args.spec_disable_rows, "stream": args.stream, "overlap": args.overlap,
               "gil_threads": args.gil_threads, "switch_interval_s": sys.getswitchinterval(),
               "chain_graph": chained is not None, "requests_per_prompt": args.requests_per_prompt,
               "decode_steps": args.decode_steps,
               "environment": environment(), "runs": {}}
    handle = _Drop()
    for k in draft_counts:
        profiler = torch.profiler.profile() if args.profile and k == draft_counts[-1] else contextlib.nullcontext()
        warm_up = Scheduler(hops, limits)  # untimed: a compiled step compiles its prefill shapes on first use
        for prompt in prompts:
            warm_up.submit(GenerationRequest(input_ids=prompt, max_tokens=2, num_draft_tokens=k), handle)
        warm_up.run_until_idle()
        engine = Scheduler(hops, limits, tokenizer=tokenizer if args.stream else None,
                           stream_interval=args.stream or 1, spec_disable_rows=args.spec_disable_rows,
                           overlap=args.overlap)
        for i, prompt in enumerate(prompts):
            request = GenerationRequest(input_ids=prompt, max_tokens=args.max_tokens, num_draft_tokens=k,
                                        stream=bool(args.stream))
            first = request
            if args.requests_per_prompt > 1:  # the streams drift apart from the start
                first = dataclasses.replace(request, max_tokens=max(1, (i + 1) * args.max_tokens // len(prompts)))
            engine.submit(first, _Resubmit(engine, request, args.requests_per_prompt - 1, handle))
        if args.null_replays:  # the prefill runs the model (eager): only the decode steps' host work is timed
            engine.step()
        timed_target.seconds = timed_mtp.seconds = 0.0
        if timed_steps:
            timed_steps.seconds = 0.0
        counters = engine.metrics.counters
        untimed = {name: counters[name] for name in ("spec_decode_emitted_tokens", "spec_decode_calls_ahead",
                                                     "spec_decode_hops")}
        untimed_streamed = handle.streamed
        steps, start = 0, time.perf_counter()

        def loop() -> str:
            nonlocal steps
            with profiler:
                while not engine.idle:
                    engine.step()
                    steps += 1
                synchronize(device)
            return threading.current_thread().name

        with gil_contention(args.gil_threads):
            if args.thread:  # as the served scheduler steps: not on the main thread
                with ThreadPoolExecutor(1, thread_name_prefix="engine-steps") as pool:
                    stepped_on = pool.submit(loop).result()  # its exception, if any, raised here
            else:
                stepped_on = loop()
        total = time.perf_counter() - start
        if args.profile and k == draft_counts[-1]:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            Path(args.profile).write_text(f"k={k}, {steps} steps (times include the profiler's own cost)\n{table}\n")
        if handle.errors:
            raise RuntimeError(f"k={k}: {handle.errors[0]}")
        target_seconds = timed_target.seconds + (timed_steps.seconds if timed_steps else 0.0)
        model = target_seconds + timed_mtp.seconds
        target_ms = 1e3 * target_seconds / steps if timed_target.timed else None  # else counted as engine
        mtp_ms = 1e3 * timed_mtp.seconds / steps if timed_mtp.timed else None
        run_result = {"steps": steps, "step_ms": 1e3 * total / steps, "target_ms": target_ms, "mtp_ms": mtp_ms,
                      "engine_ms": 1e3 * (total - model) / steps,
                      "tokens": counters["spec_decode_emitted_tokens"] - untimed["spec_decode_emitted_tokens"],
                      "calls_ahead": counters["spec_decode_calls_ahead"] - untimed["spec_decode_calls_ahead"],
                      "hops": counters["spec_decode_hops"] - untimed["spec_decode_hops"],
                      "streamed_responses": handle.streamed - untimed_streamed,  # before the final ones
                      "stepped_on": stepped_on,
                      "profiled": bool(args.profile) and k == draft_counts[-1]}  # timings then include the profiler's
        results["runs"][str(k)] = run_result
        print(f"k={k}: {steps} steps, {run_result['step_ms']:.2f} ms/step ({run_result['tokens'] / steps:.2f} tokens) = "
              f"target {_ms(target_ms)} + mtp {_ms(mtp_ms)} + engine {run_result['engine_ms']:.2f}; "
              f"{run_result['calls_ahead']} of {run_result['hops']} hops launched ahead", flush=True)
    if args.out:
        write_result(args.out, results)
    return results


def _ms(value: float | None) -> str:
    return "untimed" if value is None else f"{value:.2f}"


class _Drop:
    """A response handle that keeps only errors and a count of the responses before the final ones (the
    engine's counters are what is measured)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.streamed = 0

    def send(self, response, final: bool) -> None:
        response.to_arrays(final)  # as the server's handle converts it before sending
        self.streamed += not final

    def send_error(self, message: str) -> None:
        self.errors.append(message)

    def is_cancelled(self) -> bool:
        return False


class _Resubmit:
    """A closed-loop stream's handle: sends go to `handle`, and a final response submits the request again while
    `remaining` are left."""

    def __init__(self, engine: Scheduler, request: GenerationRequest, remaining: int, handle: _Drop) -> None:
        self.engine, self.request, self.remaining, self.handle = engine, request, remaining, handle

    def send(self, response, final: bool) -> None:
        self.handle.send(response, final)
        if final and self.remaining:
            self.remaining -= 1
            self.engine.submit(self.request, self)

    def send_error(self, message: str) -> None:
        self.handle.send_error(message)

    def is_cancelled(self) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-slots", type=int, help="KV-cache slots (default: --prompts; gpu_bench exports 64)")
    parser.add_argument("--draft-tokens", default="0,3", help="comma-separated k values (0 = plain)")
    parser.add_argument("--graphs", action="store_true", help="replay the model calls from decode graphs (CUDA)")
    parser.add_argument("--null-replays", action="store_true",
                        help="with --graphs: replays that do no work, so a step costs the host's work alone")
    parser.add_argument("--moe", choices=MOE_KINDS, help="routed experts (export/moe.py; default as the eager export)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model steps as the eager format loads them (export.formats.eager.compile_step)")
    parser.add_argument("--spec-disable-rows", type=int, default=0,
                        help="steps with more live rows decode without drafts (export --spec-disable-rows)")
    parser.add_argument("--overlap", action="store_true",
                        help="plain steps launch the next target call before reading theirs, greedy speculative "
                        "steps chain their drafting to it (export's default; the model calls are then not timed apart)")
    parser.add_argument("--stream", type=int, default=0, metavar="N",
                        help="stream the requests with the checkpoint's tokenizer, a response per N tokens "
                        "(export --stream-interval N), as served requests are; default: not streamed, no tokenizer")
    parser.add_argument("--thread", action="store_true", help="step on a second thread, as the served scheduler does")
    parser.add_argument("--no-chain-graph", action="store_true",
                        help="with --graphs --overlap: chained steps draft through the drafting chain's graphs and the "
                             "ops around them, not the chain graph (graphs.GraphedChain)")
    parser.add_argument("--gil-threads", type=int, default=0, metavar="N",
                        help="N threads that hold the GIL 50 of every 200 us while the steps run (the served process's "
                             "response threads)")
    parser.add_argument("--switch-interval-us", type=float,
                        help="sys.setswitchinterval, as spec_decode's switch_interval_us sets it (default: Python's)")
    parser.add_argument("--requests-per-prompt", type=int, default=1, metavar="N",
                        help="each prompt a closed-loop stream of N requests: requests arrive while others decode")
    parser.add_argument("--decode-steps", type=int, default=1, metavar="N",
                        help="target steps a call over greedy rows without drafts (the scheduler's multi-step decoding; "
                        "with --graphs, one graph of N steps)")
    parser.add_argument("--profile", help="write the op table of the last k's run to this file")
    parser.add_argument("--out", help="result JSON file")
    args = parser.parse_args(argv)
    if args.graphs and not args.device.startswith("cuda") and not args.null_replays:
        parser.error("--graphs needs --device cuda (or --null-replays)")
    if args.null_replays and not args.graphs:
        parser.error("--null-replays replaces the decode graphs: add --graphs")
    if args.switch_interval_us is not None:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
