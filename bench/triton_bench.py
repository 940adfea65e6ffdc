"""Plain vs MTP speculative decoding through Triton: gRPC streaming against `spec_decode`, greedy.

Uses tritonclient directly (one gRPC stream per concurrent client, one request in flight per stream).
Measures, on held-out code prompts:

1. batch 1: plain (`num_draft_tokens` 0) and k = 1..4, one stream;
2. a concurrency sweep (1, 2, 4, ... streams) for plain and the best k of step 1.

Per run: aggregate tokens/s (tokens received / wall time), TTFT, inter-token latency p50/p99, the engine's
steps and their mean time per phase (hops, responses, the rest) from spec_decode's counters
(genai-perf's convention: a response's gap to the previous one divided by the tokens it carries),
acceptance per position and mean accepted length (from the final responses' totals), and hops per
emitted token (the engine's `spec_decode_hops` counter: its calls into the target and MTP workers, BLS
calls or, with local hops, calls in its own process, per token received). With BLS hops, the server
time per call of the `target` and `mtp` models comes from their `nv_inference_*` metrics.

    python -m bench.triton_bench --checkpoint DIR --repository REPO --out triton.json
    python -m bench.triton_bench --checkpoint DIR --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics ...
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import queue
import re
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from .common import acceptance_summary, environment, held_out_prompts, latency_summary, write_result

MODEL = "spec_decode"
HOP_MODELS = ("target", "mtp")
RESPONSE_TIMEOUT_S = 300.0
STOP_GRACE_S = 5.0  # the stage's time limit leaves little room for a slow shutdown
_COUNTER = re.compile(r'^(nv_inference_request_success|nv_inference_compute_infer_duration_us|nv_inference_request_duration_us)'
                      r'\{[^}]*model="([^"]+)"[^}]*\}\s+([0-9.e+]+)', re.MULTILINE)
_ENGINE = {name: re.compile(rf'^{name}(?:\{{[^}}]*\}})?\s+([0-9.e+]+)', re.MULTILINE)
           for name in ("spec_decode_hops", "spec_decode_steps", "spec_decode_chained_calls", "spec_decode_calls_ahead")}
_PHASES = re.compile(r'^spec_decode_step_seconds\{[^}]*phase="([^"]+)"[^}]*\}\s+([0-9.e+]+)', re.MULTILINE)


@dataclass
class RequestStats:
    """What one streamed request gave back."""

    output_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    gaps: list[float] = field(default_factory=list)  # per response after the first: seconds / tokens carried
    total_draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def _scalar(result: grpcclient.InferResult, name: str) -> int | None:
    array = result.as_numpy(name)
    return None if array is None or array.size == 0 else int(array.reshape(-1)[0])


class StreamClient:
    """One gRPC connection with one bidirectional stream; `generate` sends a request and reads it to the end."""

    def __init__(self, url: str, model: str = MODEL) -> None:
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((time.perf_counter(), result, error)))

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()

    def generate(self, prompt: list[int], max_tokens: int, num_draft_tokens: int, request_id: str) -> RequestStats:
        values = {"input_ids": np.asarray(prompt, dtype=np.int32), "max_tokens": np.asarray([max_tokens], np.int32),
                  "num_draft_tokens": np.asarray([num_draft_tokens], np.int32),
                  "temperature": np.asarray([0.0], np.float32), "stream": np.asarray([True])}
        inputs = []
        for name, value in values.items():
            tensor = grpcclient.InferInput(name, list(value.shape), {"i": "INT32", "f": "FP32", "b": "BOOL"}[value.dtype.kind])
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        stats = RequestStats()
        sent = last = time.perf_counter()
        self.client.async_stream_infer(self.model, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            now, result, error = self.responses.get(timeout=RESPONSE_TIMEOUT_S)
            if error is not None:
                raise RuntimeError(f"{self.model} request {request_id}: {error}")
            ids = result.as_numpy("output_ids")
            n = 0 if ids is None else int(ids.size)
            if n:
                if not stats.output_ids:
                    stats.ttft_s = now - sent
                else:
                    stats.gaps.append((now - last) / n)
                stats.output_ids += ids.reshape(-1).tolist()
                last = now
            drafts = _scalar(result, "total_draft_tokens")
            if drafts is not None:
                stats.total_draft_tokens = drafts
                stats.accepted = _scalar(result, "total_accepted_draft_tokens") or 0
                per_position = result.as_numpy("accepted_per_position")
                stats.accepted_per_position = [] if per_position is None else per_position.astype(int).tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                stats.total_s = last - sent
                return stats


def server_counters(metrics_url: str) -> dict[tuple[str, str], float]:
    """(metric, model) -> value for requests served and their compute / request microseconds, and the
    engine's hops, steps, chained calls and calls ahead under (counter, spec_decode), from the server's
    Prometheus endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    counters: dict[tuple[str, str], float] = {}
    for metric, model, value in _COUNTER.findall(text):
        counters[metric, model] = counters.get((metric, model), 0.0) + float(value)
    for name, pattern in _ENGINE.items():
        counters[name, MODEL] = sum(float(value) for value in pattern.findall(text))
    for phase, value in _PHASES.findall(text):
        counters["spec_decode_step_seconds", phase] = float(value)
    return counters


def step_phases_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per engine step in each phase (mtp, target, respond, engine) over the run, from
    spec_decode's own counters: where a step's time goes inside the server."""
    steps = after["spec_decode_steps", MODEL] - before["spec_decode_steps", MODEL]
    return {phase: 1e3 * (after[metric, phase] - before.get((metric, phase), 0.0)) / steps
            for metric, phase in after if metric == "spec_decode_step_seconds" and steps}


def per_call_ms(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per hop model: calls, and the mean compute (the model's execute) and request (queue included)
    milliseconds of a call over the run: how much of a step the models themselves take."""
    def delta(metric: str, model: str) -> float:
        return after.get((metric, model), 0.0) - before.get((metric, model), 0.0)

    result = {}
    for model in HOP_MODELS:
        calls = delta("nv_inference_request_success", model)
        result[model] = {
            "calls": calls,
            "compute_ms": delta("nv_inference_compute_infer_duration_us", model) / calls / 1e3 if calls else 0.0,
            "request_ms": delta("nv_inference_request_duration_us", model) / calls / 1e3 if calls else 0.0,
        }
    return result


def run_level(url: str, metrics_url: str, prompts: list[list[int]], streams: int, requests: int,
              max_tokens: int, k: int, keep_outputs: bool = False, model: str = MODEL) -> dict:
    """`requests` requests to `model` over `streams` concurrent streams (prompts cycled); the run's summary.
    The engine's counters are the server's whole (one `spec_decode` model's while only it is busy).

    keep_outputs: add each request's output ids, in request order, as "outputs".
    """
    work = queue.Queue()
    for i, prompt in zip(range(requests), itertools.cycle(prompts)):
        work.put((i, prompt))
    stats: dict[int, RequestStats] = {}
    errors: list[str] = []
    lock = threading.Lock()
    clients = [StreamClient(url, model) for _ in range(streams)]

    def worker(client: StreamClient) -> None:
        while True:
            try:
                i, prompt = work.get_nowait()
            except queue.Empty:
                return
            try:
                s = client.generate(prompt, max_tokens, k, f"k{k}-c{streams}-{i}")
            except Exception as exc:  # noqa: BLE001 - reported in the result and re-raised below
                with lock:
                    errors.append(str(exc))
                return
            with lock:
                stats[i] = s

    before = server_counters(metrics_url)
    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = server_counters(metrics_url)
    for c in clients:
        c.close()
    if errors:
        raise RuntimeError(f"{len(errors)} of {requests} requests failed at {streams} streams, k={k}: {errors[0]}")
    outputs = [stats[i].output_ids for i in sorted(stats)]
    stats = list(stats.values())
    tokens = sum(len(s.output_ids) for s in stats)
    models = per_call_ms(before, after)
    hops = after["spec_decode_hops", MODEL] - before["spec_decode_hops", MODEL]
    result = {
        "num_draft_tokens": k, "streams": streams, "requests": len(stats), "output_tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
        "per_stream_tokens_per_s": float(np.mean([len(s.output_ids) / s.total_s for s in stats if s.total_s])) if stats else 0.0,
        "ttft": latency_summary([s.ttft_s for s in stats]),
        "itl": latency_summary([g for s in stats for g in s.gaps]),
        "hops": hops, "hops_per_token": hops / tokens if tokens else 0.0, "models": models,
        "steps": after["spec_decode_steps", MODEL] - before["spec_decode_steps", MODEL],
        "step_ms": step_phases_ms(before, after),
        "chained_calls": after["spec_decode_chained_calls", MODEL] - before["spec_decode_chained_calls", MODEL],
        "calls_ahead": after["spec_decode_calls_ahead", MODEL] - before["spec_decode_calls_ahead", MODEL],
    }
    if keep_outputs:
        result["outputs"] = outputs
    if k:
        per_position = [sum(s.accepted_per_position[j] for s in stats if j < len(s.accepted_per_position))
                        for j in range(k)]
        steps_with_drafts = _drafting_steps(stats, k)
        result.update(acceptance_summary(per_position, steps_with_drafts, sum(s.accepted for s in stats)))
    return result


def _drafting_steps(stats: list[RequestStats], k: int) -> int:
    """Verify steps that carried drafts, estimated as ceil(total_draft_tokens / k) per request.

    The server reports totals, not steps; every step drafts k except near max_tokens, where it drafts fewer.
    """
    return sum(-(-s.total_draft_tokens // k) for s in stats)


def run(args: argparse.Namespace, url: str, metrics_url: str) -> dict:
    prompts = held_out_prompts(args.checkpoint, args.prompts, args.prompt_tokens)
    draft_counts = [int(k) for k in args.draft_tokens.split(",") if k]
    result = {"benchmark": "triton", "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "environment": environment(), "batch1": {}, "sweep": {}}
    for k in [0, *draft_counts]:
        run_level(url, metrics_url, prompts, 1, args.warmup, args.max_tokens, k)
        level = run_level(url, metrics_url, prompts, 1, len(prompts), args.max_tokens, k, keep_outputs=True)
        result["batch1"][str(k)] = level
        phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in level["step_ms"].items())
        print(f"triton batch 1, k={k}: {level['tokens_per_s']:.1f} tokens/s, "
              f"{level['hops_per_token']:.2f} hops/token, ms per step: {phases}", flush=True)
        write_result(args.out, result)  # what is done so far survives a time limit
    spec = {k: result["batch1"][str(k)]["tokens_per_s"] for k in draft_counts}
    best_k = max(spec, key=spec.get) if spec else 0
    result["best_k"] = best_k
    modes = {"plain": 0, "spec": best_k} if best_k else {"plain": 0}
    for streams in [int(c) for c in args.concurrency.split(",") if c]:  # plain and spec side by side per level
        requests = max(streams * args.requests_per_stream, len(prompts))
        for name, k in modes.items():
            run_level(url, metrics_url, prompts, streams, streams, min(args.max_tokens, 16), k)  # new batch shapes
            level = run_level(url, metrics_url, prompts, streams, requests, args.max_tokens, k)
            result["sweep"].setdefault(name, {})[str(streams)] = level
            print(f"triton {name} (k={k}) {streams} streams: {level['tokens_per_s']:.1f} tokens/s, "
                  f"ITL p50 {level['itl']['p50_ms']:.2f} ms", flush=True)
            write_result(args.out, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory the repository was exported from")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--repository", help="model repository to serve with an embedded tritonserver")
    target.add_argument("--url", help="gRPC address of a running server (host:port)")
    parser.add_argument("--metrics-url", help="Prometheus endpoint of that server (with --url)")
    parser.add_argument("--server-log", help="where the embedded server writes its log")
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--draft-tokens", default="1,2,3,4")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per k before batch 1")
    parser.add_argument("--ready-timeout", type=float, default=600.0)


def run_cli(args: argparse.Namespace) -> int:
    """Serve `--repository` (or use `--url`), measure, write `--out`."""
    if args.url and not args.metrics_url:
        raise SystemExit("--metrics-url is required with --url")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the server on timeout
    with contextlib.ExitStack() as stack:
        if args.repository:
            from triton_mtp.serving.server import TritonServer, free_ports

            grpc_port, http_port, metrics_port = free_ports(3)
            server = TritonServer(args.repository, grpc_port, http_port, metrics_port, log_path=args.server_log)
            server.start()
            stack.callback(server.stop, STOP_GRACE_S)
            server.wait_ready(args.ready_timeout)
            url, metrics_url = server.grpc_url, server.metrics_url
        else:
            url, metrics_url = args.url, args.metrics_url
        run(args, url, metrics_url)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """`triton-mtp bench`: this benchmark from the command line."""
    parser = subparsers.add_parser("bench", help="plain vs speculative decoding through Triton: batch 1 and a "
                                   "concurrency sweep", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run_cli)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
