"""Triton's HTTP generate extension in front of `spec_decode`, driven with `requests`: the curl lines
of docs/client.md against tests/models/toy_spec_decode (text prompts), and the same two endpoints
against the real engine (conftest `spec_decode_repository`, id prompts)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import requests

DOC = Path(__file__).parents[1] / "docs" / "client.md"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(toy_spec_decode_server):
    return toy_spec_decode_server


@pytest.fixture(scope="module")
def engine(triton_server_for, spec_decode_repository):
    return triton_server_for(spec_decode_repository)


def documented_curl() -> dict[str, dict]:
    """Endpoint (`generate`, `generate_stream`) -> JSON body of each curl line in the doc."""
    calls = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("curl "):
            words = shlex.split(line)
            url = next(w for w in words if w.startswith("localhost:8000/"))
            calls[url.rsplit("/", 1)[1]] = json.loads(words[words.index("-d") + 1])
    return calls


def post(server, endpoint: str, body: dict) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v2/models/spec_decode/{endpoint}", json=body, timeout=TIMEOUT_S)


def events(reply: requests.Response) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in reply.text.splitlines() if line.startswith("data:")]


def as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def test_the_doc_shows_both_endpoints():
    calls = documented_curl()
    assert set(calls) == {"generate", "generate_stream"}
    assert calls["generate_stream"]["stream"] is True
    assert calls["generate"]["text_input"] == calls["generate_stream"]["text_input"]


def check_generate_and_generate_stream_agree(server, one_body: dict, stream_body: dict) -> None:
    whole = post(server, "generate", one_body)
    assert whole.status_code == 200, whole.text
    one = whole.json()
    assert one["finish_reason"] == "length"
    assert one["num_output_tokens"] == len(as_list(one["output_ids"])) == one_body["max_tokens"]
    assert isinstance(one["text_output"], str)

    streamed = post(server, "generate_stream", stream_body)
    assert streamed.status_code == 200 and streamed.headers["Content-Type"].startswith("text/event-stream")
    steps = events(streamed)
    assert len(steps) > 1 and all("error" not in s for s in steps)
    assert [i for s in steps for i in as_list(s["output_ids"])] == as_list(one["output_ids"])
    assert "".join(s["text_output"] for s in steps) == one["text_output"]
    final = steps[-1]
    for name in ("num_input_tokens", "num_output_tokens", "total_draft_tokens", "total_accepted_draft_tokens"):
        assert final[name] == one[name], name
    assert not steps[0].get("finish_reason") and final["finish_reason"] == "length"


def test_documented_generate_and_generate_stream_agree(server):
    calls = documented_curl()
    check_generate_and_generate_stream_agree(server, calls["generate"], calls["generate_stream"])


def test_generate_and_generate_stream_agree_on_the_engine(engine):
    body = {"input_ids": [9, 10, 11], "max_tokens": 16, "num_draft_tokens": 3}
    check_generate_and_generate_stream_agree(engine, body, {**body, "stream": True})


def test_bad_input_is_400_with_the_servers_message(server):
    body = {**documented_curl()["generate"], "max_tokens": 0}
    reply = post(server, "generate", body)
    assert reply.status_code == 400 and "max_tokens" in reply.json()["error"]
    streamed = post(server, "generate_stream", {**body, "stream": True})
    assert streamed.status_code == 400 and "max_tokens" in events(streamed)[0]["error"]
