"""The client library against a real tritonserver: sync and asyncio, gRPC and HTTP, streaming,
cancellation, timeouts and typed errors.

`engine` serves the real `spec_decode` (conftest `spec_decode_repository`: the tiny DeepSeek-V3);
`server` serves tests/models/toy_spec_decode, the public interface over a fake engine whose requests
can run for as long as a test needs. Both count live sequences in `spec_decode_live_sequences` and
finished requests in `spec_decode_finished_requests{reason}`.
"""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from triton_mtp.client import (
    Acceptance,
    AsyncClient,
    Client,
    Completion,
    Delta,
    GenerateTimeoutError,
    InvalidArgumentError,
    ServerUnreachableError,
    UnavailableError,
)
from triton_mtp.client import errors
from triton_mtp.serving.server import free_port

PROTOCOLS = ["grpc", "http"]
LIVE = "spec_decode_live_sequences"
CANCELLED = 'spec_decode_finished_requests{reason="cancelled"}'
LONG = 100_000  # max_tokens of a toy request that only ends when cancelled
TOY_SLOTS = 16  # max_slots in tests/models/toy_spec_decode/config.pbtxt
ENGINE_SLOTS = 4  # max_slots of spec_decode_repository
ENGINE_LONG = 120  # max_tokens that fill its max_seq_len (128) after a two-token prompt


@pytest.fixture(scope="module")
def server(toy_spec_decode_server):
    return toy_spec_decode_server


@pytest.fixture(scope="module")
def engine(triton_server_for, spec_decode_repository):
    return triton_server_for(spec_decode_repository)


def url_of(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def metrics(server) -> dict[str, float]:
    """Series (name with labels) -> value, from the server's Prometheus endpoint."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def gauge(server, series: str) -> float:
    return metrics(server)[series]


def wait_for(server, series: str, value: float, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while gauge(server, series) != value:
        assert time.monotonic() < deadline, f"{series} stayed at {gauge(server, series)}, expected {value}"
        time.sleep(0.05)


async def async_generate(url: str, protocol: str, stream: bool, **request) -> Completion:
    async with AsyncClient(url, protocol=protocol, timeout=60) as client:
        if not stream:
            return await client.generate(**request)
        items = [item async for item in client.stream(**request)]
        return items[-1]


def sync_generate(url: str, protocol: str, stream: bool, **request) -> Completion:
    with Client(url, protocol=protocol, timeout=60) as client:
        return list(client.stream(**request))[-1] if stream else client.generate(**request)


def test_greedy_ids_are_identical_for_sync_async_grpc_http_stream_and_not(engine):
    request = {"input_ids": [9, 10, 11], "max_tokens": 24, "num_draft_tokens": 3, "temperature": 0.0}
    results = {}
    for protocol in PROTOCOLS:
        url = url_of(engine, protocol)
        for stream in (False, True):
            results[protocol, "sync", stream] = sync_generate(url, protocol, stream, **request)
            results[protocol, "async", stream] = asyncio.run(async_generate(url, protocol, stream, **request))
    reference = results["grpc", "sync", False]
    assert len(reference.ids) == 24 and reference.finish_reason == "length"
    assert reference.acceptance.accepted_draft_tokens > 0
    for key, completion in results.items():
        assert completion.ids == reference.ids, key
        assert completion.text == reference.text, key
        assert completion.usage == reference.usage, key
        assert completion.acceptance == reference.acceptance, key


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("serving", ["server", "engine"])
def test_stream_yields_each_steps_tokens_then_the_completion(request, serving, protocol):
    server = request.getfixturevalue(serving)
    with Client(url_of(server, protocol), protocol=protocol, timeout=60) as client:
        items = list(client.stream(input_ids=[104, 105], max_tokens=12, num_draft_tokens=3, return_logprobs=True))
        whole = client.generate(input_ids=[104, 105], max_tokens=12, num_draft_tokens=3, return_logprobs=True)
    *deltas, completion = items
    assert len(deltas) > 1 and all(isinstance(d, Delta) and d.ids for d in deltas)
    assert isinstance(completion, Completion)
    assert [i for d in deltas for i in d.ids] == completion.ids == whole.ids
    assert "".join(d.text for d in deltas) == completion.text
    assert completion.logprobs == pytest.approx(whole.logprobs) and len(completion.logprobs) == 12
    assert completion.usage.input_tokens == 2 and completion.usage.output_tokens == 12
    assert completion.acceptance.steps == len(deltas) - 1  # one response for prefill, one per step


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_request_options_reach_the_server(server, protocol):
    with Client(url_of(server, protocol), protocol=protocol, timeout=60) as client:
        by_text = client.generate("hi", max_tokens=10)
        by_ids = client.generate(input_ids=list(b"hi"), max_tokens=10)
        stopped = client.generate("hi", max_tokens=40, stop=[by_text.text[5:7]])
        seeded = [client.generate("hi", max_tokens=10, temperature=1.0, seed=s).ids for s in (1, 1, 2)]
        no_drafts = client.generate("hi", max_tokens=10, num_draft_tokens=0)
    assert by_ids.ids == by_text.ids
    assert stopped.finish_reason == "stop" and stopped.text == by_text.text[:5]
    assert seeded[0] == seeded[1] != seeded[2]
    assert no_drafts.ids == by_text.ids and no_drafts.acceptance.draft_tokens == 0
    assert no_drafts.acceptance.acceptance_rate is None


def test_the_documented_python_examples_run(server, capsys):
    doc = (Path(__file__).parents[1] / "docs" / "client.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block.replace("localhost:8001", server.grpc_url), "docs/client.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"acceptance \d+%, mean accepted length \d\.\d\d", out)
    assert "Completion(" in out and "Delta(" in out

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    exec(compile(block.replace("localhost:8001", server.grpc_url), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r" length\nmean accepted length \d\.\d\d\n", out), out


def test_acceptance_figures_follow_the_vllm_conventions():
    stats = Acceptance(draft_tokens=12, accepted_draft_tokens=5, accepted_per_position=[3, 2, 0], steps=4)
    assert stats.acceptance_rate == pytest.approx(5 / 12)
    assert stats.mean_accepted_length == pytest.approx(1 + 5 / 4)
    no_drafts = Acceptance(draft_tokens=0, accepted_draft_tokens=0, accepted_per_position=[], steps=9)
    assert no_drafts.acceptance_rate is None and no_drafts.mean_accepted_length is None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_leaving_a_sync_stream_early_frees_its_slot(engine, protocol):
    before = gauge(engine, CANCELLED)
    request = {"input_ids": [9, 10], "max_tokens": ENGINE_LONG, "num_draft_tokens": 0}
    with Client(url_of(engine, protocol), protocol=protocol, timeout=60) as client:
        for _ in client.stream(**request):
            break
        wait_for(engine, CANCELLED, before + 1)
        wait_for(engine, LIVE, 0)
        assert gauge(engine, "spec_decode_free_slots") == ENGINE_SLOTS
        assert client.generate(**request).usage.output_tokens == request["max_tokens"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cancelling_an_async_task_frees_its_slot(engine, protocol):
    before = gauge(engine, CANCELLED)

    async def scenario() -> None:
        async with AsyncClient(url_of(engine, protocol), protocol=protocol, timeout=60) as client:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in client.stream(input_ids=[9, 10], max_tokens=ENGINE_LONG, num_draft_tokens=0):
                    started.set()
                    await asyncio.sleep(3600)  # cancelled here, inside the loop body

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(wait_for, engine, CANCELLED, before + 1)

    asyncio.run(scenario())
    wait_for(engine, LIVE, 0)
    assert gauge(engine, "spec_decode_free_slots") == ENGINE_SLOTS


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_timeout_raises_and_frees_the_slot(server, protocol):
    with Client(url_of(server, protocol), protocol=protocol, timeout=0.5) as client:
        with pytest.raises(GenerateTimeoutError, match="timed out after 0.5s"):
            client.generate("hi", max_tokens=LONG)
        with pytest.raises(TimeoutError):
            list(client.stream("hi", max_tokens=LONG))
    wait_for(server, LIVE, 0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_invalid_argument_carries_the_servers_message(server, protocol):
    with Client(url_of(server, protocol), protocol=protocol, timeout=60) as client:
        with pytest.raises(InvalidArgumentError) as raised:
            client.generate("hi", max_tokens=0)
        assert raised.value.message == "max_tokens must be positive, got 0"
        with pytest.raises(InvalidArgumentError, match="num_draft_tokens"):
            list(client.stream("hi", max_tokens=5, num_draft_tokens=99))
        assert len(client.generate("hi", max_tokens=2).ids) == 2


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unknown_model_is_unavailable(server, protocol):
    with Client(url_of(server, protocol), protocol=protocol, timeout=60, model="no_such_model") as client:
        with pytest.raises(UnavailableError, match="no_such_model"):
            client.generate("hi", max_tokens=2)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_all_slots_busy_is_unavailable(server, protocol):
    async def scenario() -> None:
        async with AsyncClient(url_of(server, protocol), protocol=protocol, timeout=60) as client:
            async def hold() -> None:
                async for _ in client.stream("hi", max_tokens=LONG):
                    pass

            holders = [asyncio.create_task(hold()) for _ in range(TOY_SLOTS)]
            await asyncio.to_thread(wait_for, server, LIVE, TOY_SLOTS)
            with pytest.raises(UnavailableError, match=f"all {TOY_SLOTS} slots are busy"):
                await client.generate("hi", max_tokens=2)
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)

    asyncio.run(scenario())
    wait_for(server, LIVE, 0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_connection_refused_names_the_url(protocol):
    url = f"127.0.0.1:{free_port()}"
    with Client(url, protocol=protocol, timeout=10) as client:
        with pytest.raises(ServerUnreachableError, match=url) as raised:
            client.generate("hi", max_tokens=2)
    assert raised.value.url == url


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_retries_end_with_the_last_error_when_the_server_stays_down(protocol):
    url = f"127.0.0.1:{free_port()}"
    with Client(url, protocol=protocol, timeout=10, retries=2, retry_delay=0.2) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnreachableError, match=url):
            client.generate("hi", max_tokens=2)
    assert time.monotonic() - started >= 0.2 + 0.4  # waited between the three attempts


def test_the_servers_request_timeout_is_a_timeout_error():
    error = errors.from_message("request_timeout_s: the request did not finish within 600 s", "h:1")
    assert isinstance(error, GenerateTimeoutError) and isinstance(error, TimeoutError)


def test_bad_arguments_are_refused_before_sending():
    with pytest.raises(ValueError, match="protocol"):
        Client("localhost:1", protocol="udp")
    with pytest.raises(ValueError, match="retries"):
        Client("localhost:1", retries=-1)
    with Client("localhost:1") as client:
        with pytest.raises(ValueError, match="prompt or input_ids"):
            client.generate("hi", input_ids=[1])
        with pytest.raises(ValueError, match="stop must be a list"):
            client.generate("hi", stop="\n")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_one_sync_client_serves_concurrent_threads(server, protocol):
    prompts = [f"prompt {i}" for i in range(8)]
    with Client(url_of(server, protocol), protocol=protocol, timeout=60) as client:
        alone = [client.generate(p, max_tokens=15).ids for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: [*client.stream(p, max_tokens=15)][-1].ids, prompts))
    assert together == alone
    assert len({tuple(ids) for ids in alone}) > 1


def test_one_async_client_serves_concurrent_tasks(server):
    prompts = [f"prompt {i}" for i in range(8)]

    async def scenario() -> tuple[list, list]:
        async with AsyncClient(server.grpc_url, timeout=60) as client:
            alone = [(await client.generate(p, max_tokens=15)).ids for p in prompts]
            together = await asyncio.gather(*(client.generate(p, max_tokens=15) for p in prompts))
            return alone, [c.ids for c in together]

    alone, together = asyncio.run(scenario())
    assert together == alone
