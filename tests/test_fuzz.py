"""Hypothesis-generated requests against a live `spec_decode`: random dtypes, shapes and values,
missing and extra inputs, empty and huge strings, invalid UTF-8, ids out of range.

Every response must be a well-formed result or an error naming the offending input (Triton's gRPC
stream carries no status code, so over gRPC the message is checked; over the HTTP generate endpoint
the status must be 200 or 400). Afterwards the server is healthy, answers as before and holds no slot.
"""
from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_soak import reliability_repository

from bench.soak import repository_limits, wait_for_idle

TIMEOUT_S = 60
# name -> (wire dtype, dims) as declared in model_repository/spec_decode/config.pbtxt
DECLARED = {
    "text_input": ("BYTES", [1]), "input_ids": ("INT32", [-1]), "max_tokens": ("INT32", [1]),
    "temperature": ("FP32", [1]), "top_p": ("FP32", [1]), "top_k": ("INT32", [1]), "seed": ("UINT64", [1]),
    "num_draft_tokens": ("INT32", [1]), "stop_words": ("BYTES", [-1]), "return_logprobs": ("BOOL", [1]),
    "stream": ("BOOL", [1]),
}
EXTRA_NAMES = ("INPUT0", "end_id", "max_tokens ")
NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64, "UINT32": np.uint32,
         "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}
HUGE_TEXT = b"t5 " * 200_000  # 600 KB, 200k tokens
FIELD_ERROR = re.compile(r"^([a-z_]+): \S")  # the engine's RequestError
CORE_NAMES = re.compile(r"input(?:\(s\))? \[?'([^']+)'")  # Triton's own checks: "input 'x'", "input(s) ['x']"
FUZZ = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(triton_server_for, drafting_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    return triton_server_for(reliability_repository(tmp_path_factory.getbasetemp(), drafting_checkpoint))


@pytest.fixture(scope="module")
def limits(server) -> dict[str, int]:
    return repository_limits(server.repository)


def byte_strings() -> st.SearchStrategy[bytes]:
    words = st.lists(st.integers(0, 140).map(lambda i: f"t{i}"), max_size=12).map(lambda w: " ".join(w).encode())
    return st.one_of(
        words, st.just(b""), st.just(HUGE_TEXT), st.just(b"\xff\xfe t5"), st.just(b"t5 \xc3"),
        st.binary(max_size=40), st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")),
    )


def in_range(name: str, limits: dict[str, int]) -> st.SearchStrategy:
    """Values each declared input accepts, so that most requests get past the first bad field."""
    return {
        "input_ids": st.integers(0, limits["vocab_size"] - 1), "max_tokens": st.integers(1, 20),
        "temperature": st.floats(0.0, 1.5, width=32), "top_p": st.floats(0.125, 1.0, width=32),
        "top_k": st.integers(0, 50), "seed": st.integers(0, 2**64 - 1),
        "num_draft_tokens": st.integers(0, limits["max_draft_tokens"]), "return_logprobs": st.booleans(),
        "stream": st.booleans(), "text_input": byte_strings(), "stop_words": byte_strings(),
    }[name]


def anything(wire: str, limits: dict[str, int]) -> st.SearchStrategy:
    if wire == "BYTES":
        return byte_strings()
    if wire == "BOOL":
        return st.booleans()
    if wire.startswith("FP"):
        return st.floats(width=16 if wire == "FP16" else 32)
    info = np.iinfo(NUMPY[wire])
    return st.one_of(st.integers(0, limits["vocab_size"] + 2), st.integers(int(info.min), int(info.max)))


def draw_request(data: st.DataObject, limits: dict[str, int]) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (wire dtype, array): mostly well-typed, in-range inputs; now and then anything."""
    names = {name for name in DECLARED if data.draw(st.integers(0, 9)) < 3}
    if data.draw(st.integers(0, 9)) < 7:  # exactly one prompt and max_tokens most of the time
        prompt = data.draw(st.sampled_from(["input_ids", "input_ids", "text_input"]))
        names = (names - {"input_ids", "text_input"}) | {prompt, "max_tokens"}
    if data.draw(st.integers(0, 9)) == 9:  # Hypothesis favours small draws: rare cases get the largest
        names.add(data.draw(st.sampled_from(EXTRA_NAMES)))
    request = {}
    for name in sorted(names):
        wire, dims = DECLARED.get(name, ("INT32", [1]))
        wild = data.draw(st.integers(0, 19)) == 19
        if wild:
            wire = data.draw(st.sampled_from(list(NUMPY)))
        if data.draw(st.integers(0, 19)) == 19:
            shape = data.draw(st.lists(st.integers(0, 3), max_size=3))
        else:
            shape = [data.draw(st.integers(0, 70) if wild else st.integers(1, 16)) if d == -1 else d for d in dims]
        elements = anything(wire, limits) if wild or name not in DECLARED else in_range(name, limits)
        size = int(np.prod(shape))
        array = np.array(data.draw(st.lists(elements, min_size=size, max_size=size)), dtype=NUMPY[wire])
        request[name] = (wire, array.reshape(shape))
    return request


def send(url: str, request: dict[str, tuple[str, np.ndarray]]) -> tuple[list[dict], str | None]:
    """The responses of one request on a gRPC stream, and its error message (None on success)."""
    tensors = []
    for name, (wire, array) in request.items():
        tensor = grpcclient.InferInput(name, list(array.shape), wire)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    responses = []
    try:
        client.async_stream_infer("spec_decode", tensors, enable_empty_final_response=True)
        while True:
            result, error = arrived.get(timeout=TIMEOUT_S)  # queue.Empty here means a hung request
            if error is not None:
                return responses, str(error)
            message = result.get_response()
            responses.append({o.name: result.as_numpy(o.name) for o in message.outputs})
            if message.parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        client.stop_stream()
        client.close()


def assert_well_formed(responses: list[dict], request: dict, vocab: int) -> None:
    ids = [int(t) for r in responses for t in r["output_ids"]]
    final = responses[-1]
    assert final["finish_reason"][0] in (b"length", b"stop"), final
    assert int(final["num_output_tokens"][0]) == len(ids)
    assert all(0 <= t < vocab for t in ids)
    assert 0 < len(ids) <= int(request["max_tokens"][1][0]) or final["finish_reason"][0] == b"stop"
    for r in responses:
        assert r["output_ids"].dtype == np.int32 and r["output_ids"].ndim == 1
        r["text_output"][0].decode("utf-8")


def assert_names_an_input(message: str, request: dict) -> None:
    assert message and "\n" not in message.strip() and "Traceback" not in message, message
    field = FIELD_ERROR.match(message)
    named = {field.group(1)} if field else set(CORE_NAMES.findall(message))
    assert named & (set(request) | set(DECLARED)), f"error names no input: {message!r}"


@FUZZ
@given(data=st.data())
def test_random_grpc_requests_get_a_result_or_an_error_naming_an_input(server, limits, data) -> None:
    request = draw_request(data, limits)
    responses, error = send(server.grpc_url, request)
    event("result" if error is None else "error")
    if error is None:
        assert_well_formed(responses, request, limits["vocab_size"])
    else:
        assert_names_an_input(error, request)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
              st.integers(0, 140), st.just("t5 " * 50_000)),
    lambda children: st.lists(children, max_size=4), max_leaves=8,
)


@FUZZ
@given(body=st.dictionaries(st.sampled_from(list(DECLARED) + list(EXTRA_NAMES)), JSON_VALUES, max_size=6))
def test_random_http_generate_bodies_get_200_or_400_with_a_message(server, body) -> None:
    """A JSON value of the wrong type is refused by Triton 2.51's generate frontend itself, as a 500
    "Unable to parse ..." before the model sees it (docs/reliability.md); any other 500 is a failure."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/spec_decode/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            reply = json.loads(response.read())
            assert reply["finish_reason"] in ("length", "stop") and isinstance(reply["output_ids"], list), reply
    except urllib.error.HTTPError as error:
        message = json.loads(error.read())["error"]
        assert error.code == 400 or (error.code == 500 and message.startswith("Unable to parse")), (message, body)
        assert message, body


def test_server_is_healthy_answers_as_before_and_holds_no_slot_after_fuzzing(server, limits) -> None:
    greedy = {"input_ids": ("INT32", np.array([5, 6, 7], np.int32)), "max_tokens": ("INT32", np.array([6], np.int32)),
              "num_draft_tokens": ("INT32", np.array([2], np.int32))}
    before, _ = send(server.grpc_url, greedy)
    bad = {"input_ids": ("INT32", np.array([limits["vocab_size"]], np.int32)), "max_tokens": greedy["max_tokens"]}
    _, error = send(server.grpc_url, bad)
    assert error.startswith("input_ids: token id ")
    after, error = send(server.grpc_url, greedy)
    assert error is None and after[-1]["output_ids"].tolist() == before[-1]["output_ids"].tolist()
    assert server.is_ready()
    gauges = wait_for_idle(server.metrics_url, limits["max_slots"])
    assert gauges["spec_decode_free_slots"] == limits["max_slots"]
    assert gauges["spec_decode_live_sequences"] == 0 and gauges["spec_decode_waiting_requests"] == 0
