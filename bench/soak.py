"""Soak: thousands of streamed `spec_decode` requests at fixed concurrency, every output checked.

The mix (`mixed_requests`) draws from a small pool of prompts so outputs can be compared:

- greedy requests at every k: their tokens must equal the prompt's plain greedy reference (k = 0,
  sent alone before the soak);
- seeded sampled requests, each (prompt, seed, temperature, top_p, k) sent several times: every
  copy must give the same tokens, whatever its batch neighbours;
- cancelled requests: the stream is cancelled after one or two responses.

Every stream's deltas must concatenate to its final totals (ids and text), and after the run the
engine must hold no slot (`spec_decode_free_slots`, `_live_sequences`, `_waiting_requests`).
Server memory (RSS of tritonserver and its backend stubs) is read before and after.

    python bench/soak.py                                  # 2,000 requests, 32 streams, bundled model
    python bench/soak.py --requests 500 --checkpoint DIR  # any checkpoint with MTP layers
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import re
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

RESPONSE_TIMEOUT_S = 120.0
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "tiny-dsv3-mtp"
SLOT_GAUGES = ("spec_decode_free_slots", "spec_decode_live_sequences", "spec_decode_waiting_requests")


@dataclass(frozen=True)
class SoakRequest:
    """One streamed request; `cancel_after`: cancel once this many responses arrived."""

    index: int
    kind: str  # greedy | seeded | cancelled
    prompt: int  # index into the prompt pool
    input_ids: tuple[int, ...]
    max_tokens: int
    num_draft_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    cancel_after: int | None = None

    def inputs(self, stream: bool = True) -> list[grpcclient.InferInput]:
        values = {
            "input_ids": (np.array(self.input_ids, dtype=np.int32), "INT32"),  # [P]
            "max_tokens": (np.array([self.max_tokens], dtype=np.int32), "INT32"),
            "num_draft_tokens": (np.array([self.num_draft_tokens], dtype=np.int32), "INT32"),
            "temperature": (np.array([self.temperature], dtype=np.float32), "FP32"),
            "top_p": (np.array([self.top_p], dtype=np.float32), "FP32"),
            "seed": (np.array([self.seed], dtype=np.uint64), "UINT64"),
            "stream": (np.array([stream], dtype=np.bool_), "BOOL"),
        }
        tensors = []
        for name, (array, wire) in values.items():
            tensor = grpcclient.InferInput(name, list(array.shape), wire)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors


@dataclass
class StreamResult:
    request: SoakRequest
    deltas: list[list[int]] = field(default_factory=list)  # output_ids of each response
    texts: list[str] = field(default_factory=list)  # text_output of each response
    final: dict[str, np.ndarray] | None = None
    error: str | None = None
    cancelled: bool = False
    seconds: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return [t for delta in self.deltas for t in delta]


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]
    max_tokens: int


def prompt_pool(count: int, vocab: int, max_seq_len: int, rng: random.Random, max_prompt: int = 12) -> list[Prompt]:
    pool = []
    for _ in range(count):
        ids = tuple(rng.randrange(2, vocab) for _ in range(rng.randint(1, max_prompt)))
        pool.append(Prompt(ids, rng.randint(4, min(24, max_seq_len - len(ids)))))
    return pool


def mixed_requests(count: int, pool: list[Prompt], max_draft: int, seed: int = 0) -> list[SoakRequest]:
    """`count` requests: 40% greedy (k cycling 0..max_draft), 40% seeded sampling, 20% cancelled."""
    rng = random.Random(seed)
    combos = [(rng.randrange(len(pool)), rng.randrange(2**63), rng.choice((0.7, 1.0)), rng.choice((0.9, 1.0)),
               rng.randint(0, max_draft)) for _ in range(max(1, count // 10))]
    requests = []
    for i in range(count):
        slot = i % 10
        if slot < 4:
            p = rng.randrange(len(pool))
            requests.append(SoakRequest(i, "greedy", p, pool[p].input_ids, pool[p].max_tokens, i % (max_draft + 1)))
        elif slot < 8:
            p, s, temperature, top_p, k = combos[rng.randrange(len(combos))]
            requests.append(SoakRequest(i, "seeded", p, pool[p].input_ids, pool[p].max_tokens, k,
                                        temperature, top_p, s))
        else:
            p = rng.randrange(len(pool))
            requests.append(SoakRequest(i, "cancelled", p, pool[p].input_ids, pool[p].max_tokens, rng.randint(0, max_draft),
                                        1.0, 1.0, rng.randrange(2**63), cancel_after=rng.randint(1, 2)))
    rng.shuffle(requests)
    return requests


def run_one(client: grpcclient.InferenceServerClient, request: SoakRequest, stream: bool = True,
            timeout: float = RESPONSE_TIMEOUT_S) -> StreamResult:
    """Send `request` on a fresh gRPC stream and collect its responses until the final one.

    A gap of more than `timeout` seconds between responses ends the request with an error."""
    result = StreamResult(request)
    arrived: queue.Queue = queue.Queue()
    start = time.monotonic()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    try:
        client.async_stream_infer("spec_decode", request.inputs(stream), request_id=str(request.index),
                                  enable_empty_final_response=True)
        while True:
            try:
                response, error = arrived.get(timeout=timeout)
            except queue.Empty:
                result.error = f"no response within {timeout:.0f}s"
                break
            if error is not None:
                result.error = str(error)
                break
            message = response.get_response()
            outputs = {o.name: response.as_numpy(o.name) for o in message.outputs}
            if "output_ids" in outputs:
                result.deltas.append(outputs["output_ids"].tolist())
                result.texts.append(outputs["text_output"][0].decode("utf-8"))
            if message.parameters["triton_final_response"].bool_param:
                result.final = outputs
                break
            if request.cancel_after is not None and len(result.deltas) >= request.cancel_after:
                result.cancelled = True
                break
    finally:
        client.stop_stream(cancel_requests=result.cancelled)
    result.seconds = time.monotonic() - start
    return result


def run_streams(grpc_url: str, requests: list[SoakRequest], concurrency: int) -> list[StreamResult]:
    """Run `requests` over `concurrency` client threads, each with its own connection."""
    todo: queue.Queue = queue.Queue()
    for request in requests:
        todo.put(request)
    results: list[StreamResult] = []
    lock = threading.Lock()

    def worker() -> None:
        client = grpcclient.InferenceServerClient(grpc_url)
        while True:
            try:
                request = todo.get_nowait()
            except queue.Empty:
                break
            result = run_one(client, request)
            with lock:
                results.append(result)
        client.close()

    threads = [threading.Thread(target=worker, name=f"soak-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(results, key=lambda r: r.request.index)


def greedy_references(grpc_url: str, pool: list[Prompt]) -> list[list[int]]:
    """Each prompt's plain greedy output (k = 0), one request at a time, not streamed."""
    client = grpcclient.InferenceServerClient(grpc_url)
    references = []
    for p, prompt in enumerate(pool):
        result = run_one(client, SoakRequest(-1, "greedy", p, prompt.input_ids, prompt.max_tokens, 0), stream=False)
        if result.error is not None:
            raise RuntimeError(f"reference for prompt {p} failed: {result.error}")
        references.append(result.tokens)
    client.close()
    return references


def check(results: list[StreamResult], references: list[list[int]], decode=None) -> dict[str, list[int]]:
    """Request indices failing each property; every list is empty when the soak passed.

    `decode(ids) -> str` (the repository's tokenizer) also checks that text deltas concatenate to
    the text of all emitted ids.
    """
    failures: dict[str, list[int]] = defaultdict(list)
    seeded: dict[tuple, list[StreamResult]] = defaultdict(list)
    for r in results:
        request = r.request
        if r.cancelled:
            continue
        if r.error is not None or not r.final:
            failures["error"].append(request.index)
            continue
        if int(r.final["num_output_tokens"][0]) != len(r.tokens):
            failures["deltas != num_output_tokens"].append(request.index)
        reason = r.final["finish_reason"][0].decode()
        if reason not in ("length", "stop") or (reason == "length" and len(r.tokens) != request.max_tokens):
            failures["finish_reason"].append(request.index)
        if decode is not None and "".join(r.texts) != decode(r.tokens):
            failures["text deltas != text"].append(request.index)
        if request.kind == "greedy" and r.tokens != references[request.prompt]:
            failures["greedy != reference"].append(request.index)
        if request.kind == "seeded":
            seeded[(request.prompt, request.seed, request.temperature, request.top_p, request.num_draft_tokens)].append(r)
    for copies in seeded.values():
        if any(c.tokens != copies[0].tokens for c in copies):
            failures["seeded copies differ"].extend(c.request.index for c in copies)
    return dict(failures)


def slot_gauges(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {name: float(re.search(rf"^{name}(?:{{}})? (\S+)$", text, re.MULTILINE).group(1)) for name in SLOT_GAUGES}


def wait_for_idle(metrics_url: str, max_slots: int, timeout: float = 30.0) -> dict[str, float]:
    """Slot gauges once every slot is free again (cancellations land a step later), or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = slot_gauges(metrics_url)
        idle = gauges["spec_decode_free_slots"] == max_slots and gauges["spec_decode_live_sequences"] == 0
        if (idle and gauges["spec_decode_waiting_requests"] == 0) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


def server_rss_bytes(server_pid: int) -> int:
    """Resident memory of tritonserver and every process of its group (the backend stubs)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == server_pid:  # process group id
                status = (stat.parent / "status").read_text()
                total += int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024
        except (OSError, AttributeError, IndexError):
            continue
    return total


def repository_limits(repository: Path) -> dict[str, int]:
    config = (repository / "spec_decode" / "config.pbtxt").read_text()
    return {key: int(value) for key, value in
            re.findall(r'key: "(\w+)", value: \{ string_value: "(-?\d+)" \}', config)}


def soak(repository: Path, requests: int, concurrency: int, seed: int = 0) -> dict:
    """Serve `repository`, run the soak, return the figures and failures."""
    from tokenizers import Tokenizer

    from triton_mtp.serving.server import TritonServer, free_ports

    limits = repository_limits(repository)
    tokenizer_path = repository / "spec_decode" / "1" / "tokenizer.json"
    decode = None
    if tokenizer_path.is_file():
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(seed)
    pool = prompt_pool(16, limits["vocab_size"], limits["max_seq_len"], rng)
    mix = mixed_requests(requests, pool, limits["max_draft_tokens"], seed)
    with TritonServer(repository, *free_ports(3)) as server:
        references = greedy_references(server.grpc_url, pool)
        rss_before = server_rss_bytes(server.process.pid)
        start = time.monotonic()
        results = run_streams(server.grpc_url, mix, concurrency)
        seconds = time.monotonic() - start
        gauges = wait_for_idle(server.metrics_url, limits["max_slots"])
        rss_after = server_rss_bytes(server.process.pid)
    failures = check(results, references, decode)
    if gauges["spec_decode_free_slots"] != limits["max_slots"] or gauges["spec_decode_live_sequences"]:
        failures["leaked slots"] = [int(limits["max_slots"] - gauges["spec_decode_free_slots"])]
    return {
        "requests": len(results),
        "concurrency": concurrency,
        "completed": sum(1 for r in results if r.final and not r.cancelled),
        "cancelled": sum(1 for r in results if r.cancelled),
        "tokens": sum(len(r.tokens) for r in results),
        "seconds": round(seconds, 1),
        "p99_request_s": round(float(np.percentile([r.seconds for r in results], 99)), 3),
        "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1),
        "slot_gauges_after": gauges,
        "failures": failures,
    }


def export(checkpoint: Path, out: Path, max_slots: int, max_queue: int, max_seq_len: int = 128) -> Path:
    """A TorchScript repository of `checkpoint` sized for the soak."""
    from triton_mtp.export.repository import write_repository

    write_repository(checkpoint, out, fmt="torchscript", max_slots=max_slots, max_seq_len=max_seq_len,
                     max_queue_size=max_queue, progress=False, log=lambda line: None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="checkpoint to export")
    parser.add_argument("--repository", type=Path, help="an exported repository (skips the export)")
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-repository-") as tmp:
        repository = args.repository or export(args.checkpoint, Path(tmp), args.max_slots, 2 * args.concurrency)
        report = soak(repository, args.requests, args.concurrency, args.seed)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
