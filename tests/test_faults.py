"""Faults and limits against a real server: a `target` stub killed mid-stream, a client killed
mid-stream, a server restarted under a retrying client, and the engine's limits (max_seq_len, queue,
prompt bytes) at their edges.

The server runs the conftest `spec_decode_repository` (4 slots, max_seq_len 128) with its queue cut
to 2, admin APIs restricted and explicit model control, so a dead stub can be replaced by reloading
its model (tritonserver 2.51 does not restart a killed stub by itself; see docs/reliability.md).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from bench.soak import SoakRequest, run_one, slot_gauges, wait_for_idle
from tiny_config import word_tokenizer
from triton_mtp.client import Client, UnavailableError
from triton_mtp.serving.server import TritonServer, admin_headers, free_ports

SLOTS, QUEUE, MAX_SEQ_LEN, MAX_PROMPT_BYTES = 4, 2, 128, 40
ADMIN_KEY = "faults-admin-key-0123456789"


@pytest.fixture(scope="module")
def server(triton_server_for, spec_decode_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    repository = tmp_path_factory.mktemp("faults") / "repository"
    shutil.copytree(spec_decode_repository, repository)
    config = repository / "spec_decode" / "config.pbtxt"
    text = re.sub(r'(key: "max_queue_size", value: \{ string_value: ")\d+', rf"\g<1>{QUEUE}", config.read_text())
    text = re.sub(r'(key: "max_prompt_bytes", value: \{ string_value: ")\d+', rf"\g<1>{MAX_PROMPT_BYTES}", text)
    config.write_text(text)
    word_tokenizer(repository / "spec_decode" / "1" / "tokenizer.json")  # text_input for the byte limit
    return triton_server_for(repository, admin_key=ADMIN_KEY, model_control_mode="explicit")


def request(index: int, max_tokens: int, prompt: tuple[int, ...] = (5, 6)) -> SoakRequest:
    return SoakRequest(index, "greedy", 0, prompt, max_tokens, 2)


def run_together(server, requests: list[SoakRequest], timeout: float = 60.0) -> list:
    results = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = run_one(grpcclient.InferenceServerClient(server.grpc_url), requests[i], timeout=timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    return threads, results


def test_prompt_plus_max_tokens_may_fill_max_seq_len_and_not_one_more(server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompt = (5, 6, 7, 8, 9)
    fits = run_one(client, request(0, MAX_SEQ_LEN - len(prompt), prompt), stream=False)
    assert fits.error is None, fits.error
    assert len(fits.tokens) == MAX_SEQ_LEN - len(prompt) or fits.final["finish_reason"][0] == b"stop"
    over = run_one(client, request(1, MAX_SEQ_LEN - len(prompt) + 1, prompt), stream=False)
    assert over.error == f"max_tokens: prompt (5 tokens) + max_tokens (124) exceeds max_seq_len {MAX_SEQ_LEN}"


def test_text_input_may_fill_max_prompt_bytes_and_not_one_more(server) -> None:
    with Client(server.grpc_url) as client:
        fits = client.generate("x = 1\n" * (MAX_PROMPT_BYTES // 6) + "y" * (MAX_PROMPT_BYTES % 6), max_tokens=2)
        assert len(fits.ids) == 2
        with pytest.raises(Exception, match=rf"text_input: {MAX_PROMPT_BYTES + 1} bytes exceeds max_prompt_bytes"):
            client.generate("é" + "y" * (MAX_PROMPT_BYTES - 1), max_tokens=2)  # é is two bytes


def test_queue_takes_max_queue_size_beyond_the_slots_and_refuses_the_next(server) -> None:
    threads, results = run_together(server, [request(i, 100) for i in range(SLOTS + QUEUE + 1)])
    for thread in threads:
        thread.join(timeout=120)
    refused = [r for r in results if r.error is not None]
    assert len(refused) == 1 and "slots are busy" in refused[0].error, [r.error for r in refused]
    assert all(len(r.tokens) == int(r.final["num_output_tokens"][0]) for r in results if r.error is None)
    assert wait_for_idle(server.metrics_url, SLOTS)["spec_decode_free_slots"] == SLOTS


CLIENT = """
import sys, queue, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient(sys.argv[1]); q = queue.Queue()
c.start_stream(callback=lambda result, error: q.put(error))
ins = []
for name, a, wire in (("input_ids", np.array([5, 6], np.int32), "INT32"), ("max_tokens", np.array([120], np.int32), "INT32"),
                      ("stream", np.array([True]), "BOOL")):
    t = g.InferInput(name, [a.size], wire); t.set_data_from_numpy(a); ins.append(t)
c.async_stream_infer("spec_decode", ins)
assert q.get(timeout=60) is None
print("streaming", flush=True)
q.get(timeout=600)
"""


def test_client_killed_mid_stream_frees_its_slot(server) -> None:
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.grpc_url], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "streaming"
    finally:
        client.kill()
        client.wait()
    deadline = time.monotonic() + 60
    while slot_gauges(server.metrics_url)["spec_decode_live_sequences"] > 0:
        assert time.monotonic() < deadline, "the disconnected client's sequence still holds its slot"
        time.sleep(0.1)
    assert slot_gauges(server.metrics_url)["spec_decode_free_slots"] == SLOTS


def stub_pid(server, model: str) -> int:
    """The backend stub of `model` in this server's process group."""
    prefix = f"{server.repository}/{model}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            group = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, IndexError, ValueError):
            continue
        if group == server.process.pid and argv[0].endswith(b"triton_python_backend_stub") and argv[1].startswith(prefix):
            return int(entry.name)
    raise AssertionError(f"no stub for {model}")


def test_killed_target_stub_fails_in_flight_streams_and_a_reload_restores_service(server) -> None:
    threads, results = run_together(server, [request(i, 100) for i in range(3)], timeout=60)
    deadline = time.monotonic() + 60
    while slot_gauges(server.metrics_url)["spec_decode_live_sequences"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(stub_pid(server, "target"), signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads), "an in-flight request hung"
    assert all(r.error and "target" in r.error and "not healthy" in r.error for r in results), [r.error for r in results]
    assert wait_for_idle(server.metrics_url, SLOTS)["spec_decode_free_slots"] == SLOTS

    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert "not healthy" in run_one(client, request(9, 4)).error  # 2.51 does not restart the stub
    admin = httpclient.InferenceServerClient(server.http_url)
    admin.unload_model("target", headers=admin_headers(ADMIN_KEY, "http"))
    admin.load_model("target", headers=admin_headers(ADMIN_KEY, "http"))
    later = run_one(client, request(10, 4))
    assert later.error is None and len(later.tokens) == 4, later.error


def test_client_retries_until_a_restarted_server_answers(spec_decode_repository: Path, tmp_path: Path) -> None:
    ports = dict(zip(("grpc_port", "http_port", "metrics_port"), free_ports(3)))
    with TritonServer(spec_decode_repository, **ports, log_path=tmp_path / "first.log") as first:
        url = first.grpc_url
        with Client(url) as client:
            expected = client.generate(input_ids=[5, 6, 7], max_tokens=6).ids
    with Client(url) as client:
        with pytest.raises(UnavailableError):
            client.generate(input_ids=[5, 6, 7], max_tokens=6)  # no retries: the error at once
    done: dict = {}

    def retrying() -> None:
        with Client(url, retries=60, retry_delay=0.25) as client:
            try:
                done["ids"] = client.generate(input_ids=[5, 6, 7], max_tokens=6).ids
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                done["error"] = exc

    thread = threading.Thread(target=retrying)
    thread.start()
    time.sleep(1.0)  # the client is retrying against a closed port
    assert thread.is_alive()
    with TritonServer(spec_decode_repository, **ports, log_path=tmp_path / "second.log"):
        thread.join(timeout=120)
    assert done == {"ids": expected}
