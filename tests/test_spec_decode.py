"""`spec_decode` end to end: the exported tiny DeepSeek-V3 (two MTP layers, TorchScript) behind a
real tritonserver, driven over gRPC streaming and the HTTP generate endpoint."""
from __future__ import annotations

import json
import queue
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from tiny_config import word_tokenizer
from triton_mtp.export.repository import write_repository

MAX_SLOTS = 4
MAX_SEQ_LEN = 128
MAX_DRAFT = 4
MAX_QUEUE = 16
VOCAB = 128
EOS = 1
TIMEOUT_S = 120

TYPES = {"text_input": ("BYTES", np.object_), "input_ids": ("INT32", np.int32), "max_tokens": ("INT32", np.int32),
         "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32), "top_k": ("INT32", np.int32),
         "seed": ("UINT64", np.uint64), "num_draft_tokens": ("INT32", np.int32), "stop_words": ("BYTES", np.object_),
         "return_logprobs": ("BOOL", np.bool_), "stream": ("BOOL", np.bool_)}


@pytest.fixture(scope="module")
def repository(drafting_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = shutil.copytree(drafting_checkpoint, tmp_path_factory.mktemp("worded") / "checkpoint")
    word_tokenizer(checkpoint / "tokenizer.json")
    repo = tmp_path_factory.mktemp("spec_decode_repository")
    write_repository(checkpoint, repo, fmt="torchscript", max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN,
                     max_draft_tokens=MAX_DRAFT, default_num_draft_tokens=2, max_queue_size=MAX_QUEUE,
                     progress=False, log=lambda line: None)
    return repo


@pytest.fixture(scope="module")
def server(triton_server_for, repository):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the model stubs inherit it: tiny tensors, no spinning threads
        return triton_server_for(repository)


def _inputs(request: dict) -> list:
    tensors = []
    for name, value in request.items():
        wire, dtype = TYPES[name]
        array = np.array([v.encode() if isinstance(v, str) else v for v in np.atleast_1d(value)], dtype=dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), wire)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def stream(server, requests: list[dict], cancel_after: int | None = None) -> list[list[dict]]:
    """Send every request at once on one gRPC stream; each request's responses, as dicts of arrays.

    An error response shows up as {"error": message}. With `cancel_after`, the stream is cancelled
    once that many responses have arrived.
    """
    client = grpcclient.InferenceServerClient(server.grpc_url)
    arrived: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrived.put((result, error)))
    for i, request in enumerate(requests):
        client.async_stream_infer("spec_decode", _inputs(request), request_id=str(i), enable_empty_final_response=True)
    responses: list[list[dict]] = [[] for _ in requests]
    errors, open_requests, seen = [], len(requests), 0
    while open_requests:
        result, error = arrived.get(timeout=TIMEOUT_S)
        seen += 1
        if error is not None:  # gRPC stream errors carry no request id
            errors.append({"error": str(error), "final": True})
            open_requests -= 1
            continue
        response = result.get_response()
        outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
        if response.parameters["triton_final_response"].bool_param:
            outputs["final"] = True
            open_requests -= 1
        responses[int(response.id)].append(outputs)
        if cancel_after is not None and seen >= cancel_after:
            client.stop_stream(cancel_requests=True)
            return responses
    client.stop_stream()
    for r in responses:
        if not r or not r[-1].get("final"):
            r.append(errors.pop())
    return responses


def tokens(responses: list[dict]) -> list[int]:
    assert "error" not in responses[-1], responses[-1]
    return [int(t) for r in responses for t in r.get("output_ids", [])]


def final(responses: list[dict]) -> dict:
    assert "error" not in responses[-1], responses[-1]
    return [r for r in responses if "finish_reason" in r][-1]


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("spec_decode_")}


def generate_http(server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/spec_decode/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (count,), generator=gen).tolist()
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def test_greedy_speculation_equals_plain_greedy_for_every_k(server):
    batch = prompts(20)
    plain = [tokens(r) for r in stream(server, [{"input_ids": p, "max_tokens": 12, "num_draft_tokens": 0}
                                                for p in batch])]
    before = metrics(server)
    for k in range(1, MAX_DRAFT + 1):  # k = 3, 4 exceed the two MTP layers
        spec = stream(server, [{"input_ids": p, "max_tokens": 12, "num_draft_tokens": k} for p in batch])
        assert [tokens(r) for r in spec] == plain, f"k={k}"
        assert all(final(r)["total_draft_tokens"][0] > 0 for r in spec if len(tokens(r)) > 1)
    after = metrics(server)
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert after['spec_decode_num_accepted_tokens_per_pos{position="3"}'] > 0
    assert after["spec_decode_steps"] > before["spec_decode_steps"]
    for phase in ("mtp", "target", "respond", "engine"):  # the engine's time per step phase, as Triton serves it
        assert after[f'spec_decode_step_seconds{{phase="{phase}"}}'] > before[f'spec_decode_step_seconds{{phase="{phase}"}}']


def test_greedy_tokens_and_logprobs_equal_transformers_generate(server, drafting_checkpoint):
    from transformers import DeepseekV3ForCausalLM

    reference = DeepseekV3ForCausalLM.from_pretrained(drafting_checkpoint, torch_dtype=torch.float32).eval()
    batch = prompts(4, seed=1)
    served = stream(server, [{"input_ids": p, "max_tokens": 10, "num_draft_tokens": 2, "return_logprobs": True}
                             for p in batch])
    for prompt, responses in zip(batch, served):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                                     pad_token_id=EOS, output_scores=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(prompt):].tolist()
        expected_logprobs = [float(s[0].log_softmax(-1)[t]) for s, t in zip(out.scores, expected)]
        if EOS in expected:  # spec_decode stops before EOS and does not emit it
            expected_logprobs = expected_logprobs[: expected.index(EOS)]
            expected = expected[: expected.index(EOS)]
        assert tokens(responses) == expected
        np.testing.assert_allclose(final(responses)["logprobs"], expected_logprobs, atol=1e-4)


def test_concurrent_mixed_streams_equal_the_same_requests_one_by_one(server):
    requests = [{"input_ids": p, "max_tokens": 14, "num_draft_tokens": i % (MAX_DRAFT + 1),
                 "temperature": (0.0, 0.7, 1.0)[i % 3], "seed": 1000 + i, "top_p": 0.9, "stream": True}
                for i, p in enumerate(prompts(16, seed=2))]
    together = stream(server, requests)
    alone = [stream(server, [request])[0] for request in requests]
    assert [tokens(r) for r in together] == [tokens(r) for r in alone]
    assert sum(len(r) for r in together) > 2 * len(together), "streams should send one response per step"
    for responses in together:
        assert responses[-1].get("final") and not any(r.get("final") for r in responses[:-1])
        assert all(set(r) <= {"text_output", "output_ids", "logprobs", "final"} for r in responses[:-1]), \
            "a streamed step carries its tokens only; the finish reason and totals come last"
        assert final(responses)["num_output_tokens"][0] == len(tokens(responses))
        assert final(responses)["finish_reason"][0] in (b"length", b"stop")
    live = metrics(server)
    assert live["spec_decode_free_slots"] == MAX_SLOTS
    assert live["spec_decode_live_sequences"] == 0


def test_text_prompt_streams_text_and_stops_at_a_stop_word(server):
    (by_ids,) = stream(server, [{"input_ids": [5, 6, 7], "max_tokens": 8}])
    words = [f"t{t}" for t in tokens(by_ids)]
    assert final(by_ids)["text_output"][0].decode() == " ".join(words)
    stop = words[3]
    (by_text,) = stream(server, [{"text_input": "t5 t6 t7", "max_tokens": 8, "stop_words": [stop], "stream": True}])
    text = "".join(r["text_output"][0].decode() for r in by_text if "text_output" in r)
    assert text == " ".join(words)[: " ".join(words).index(stop)]
    assert final(by_text)["finish_reason"][0] == b"stop"


def test_cancelling_a_stream_frees_its_slot(server):
    """A stream cancelled after its first response is dropped while three others share the steps."""
    cancelled = 'spec_decode_finished_requests{reason="cancelled"}'
    before = metrics(server)
    others = grpcclient.InferenceServerClient(server.grpc_url)
    finals: queue.Queue = queue.Queue()
    others.start_stream(callback=lambda result, error: finals.put(error) if error is not None or
                        result.get_response().parameters["triton_final_response"].bool_param else None)
    long_request = {"input_ids": [9, 10], "max_tokens": MAX_SEQ_LEN - 3, "num_draft_tokens": 0, "stream": True}
    for _ in range(MAX_SLOTS - 1):
        others.async_stream_infer("spec_decode", _inputs(long_request), enable_empty_final_response=True)
    stream(server, [long_request], cancel_after=1)
    deadline = time.monotonic() + 60
    while metrics(server)[cancelled] == before[cancelled]:
        assert time.monotonic() < deadline, "the cancelled sequence was not dropped"
        time.sleep(0.05)
    assert [finals.get(timeout=TIMEOUT_S) for _ in range(MAX_SLOTS - 1)] == [None] * (MAX_SLOTS - 1)
    others.stop_stream()
    after = metrics(server)
    assert after["spec_decode_free_slots"] == MAX_SLOTS
    generated = after["spec_decode_emitted_tokens"] - before["spec_decode_emitted_tokens"]
    assert generated < MAX_SLOTS * long_request["max_tokens"], "the cancelled stream ran to its end"
    (next_request,) = stream(server, [{"input_ids": [9, 10], "max_tokens": 3}])
    assert final(next_request)["finish_reason"][0] in (b"length", b"stop")


BAD_REQUESTS = [
    ({"max_tokens": 4}, "text_input"),
    ({"input_ids": [5], "text_input": "t5", "max_tokens": 4}, "text_input"),
    ({"text_input": "", "max_tokens": 4}, "text_input"),
    ({"input_ids": [5] * (MAX_SEQ_LEN - 4), "max_tokens": 5}, "max_tokens"),
    ({"input_ids": [5], "max_tokens": 0}, "max_tokens"),
    ({"input_ids": [5], "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"input_ids": [5], "max_tokens": 4, "top_p": 0.0}, "top_p"),
    ({"input_ids": [5], "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"input_ids": [5], "max_tokens": 4, "top_k": -2}, "top_k"),
    ({"input_ids": [5], "max_tokens": 4, "num_draft_tokens": -1}, "num_draft_tokens"),
    ({"input_ids": [5], "max_tokens": 4, "num_draft_tokens": MAX_DRAFT + 1}, "num_draft_tokens"),
    ({"input_ids": [5, VOCAB + 3], "max_tokens": 4}, "input_ids"),
]


@pytest.mark.parametrize("body, field", BAD_REQUESTS)
def test_bad_input_is_invalid_arg_naming_the_field_and_the_server_keeps_serving(server, body, field):
    status, reply = generate_http(server, body)
    assert status == 400, reply
    assert reply["error"].startswith(f"{field}: "), reply
    status, reply = generate_http(server, {"input_ids": [5, 6], "max_tokens": 2})
    assert status == 200 and len(reply["output_ids"]) == 2, reply


def test_wrong_dtype_or_shape_is_refused_by_name(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for name, array, wire in (("max_tokens", np.array([4.0], np.float32), "FP32"),
                              ("max_tokens", np.array([4, 4], np.int32), "INT32")):
        ids = grpcclient.InferInput("input_ids", [1], "INT32")
        ids.set_data_from_numpy(np.array([5], np.int32))
        bad = grpcclient.InferInput(name, list(array.shape), wire)
        bad.set_data_from_numpy(array)
        arrived: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: arrived.put(error))
        client.async_stream_infer("spec_decode", [ids, bad])
        error = arrived.get(timeout=TIMEOUT_S)
        client.stop_stream()
        assert error is not None and name in str(error)


def test_requests_beyond_slots_and_queue_are_unavailable(server):
    burst = MAX_SLOTS + MAX_QUEUE + 6
    replies = stream(server, [{"input_ids": [11, 12], "max_tokens": 40, "num_draft_tokens": 0}] * burst)
    refused = [r[-1]["error"] for r in replies if "error" in r[-1]]
    served = [r for r in replies if "error" not in r[-1]]
    assert refused and all("slots are busy" in e for e in refused)
    assert len(served) >= MAX_SLOTS + MAX_QUEUE
    assert all(final(r)["num_output_tokens"][0] == len(tokens(r)) for r in served)
    status, reply = generate_http(server, {"input_ids": [5, 6], "max_tokens": 2, "top_k": 3, "temperature": 0.5})
    assert status == 200, reply


def test_sampled_speculative_output_follows_the_target_distribution(server, drafting_checkpoint):
    """Tokens 1-3 over many (64-bit) seeds, through both hops, against the exact marginals (EOS ends one)."""
    from test_scheduler import chi_square_p_value, exact_marginals

    from triton_mtp.export.checkpoint import load_checkpoint

    _, target, _ = load_checkpoint(drafting_checkpoint, max_slots=16, max_seq_len=MAX_SEQ_LEN, progress=False)
    prompt, samples, temperature, top_k = [7, 19, 3], 1000, 1.3, 6
    marginals = exact_marginals(target, prompt, 3, temperature, top_k, eos=EOS)  # [3, V]
    requests = [{"input_ids": prompt, "max_tokens": 4, "temperature": temperature, "top_k": top_k,
                 "seed": (1 << 63) + seed, "num_draft_tokens": 2} for seed in range(samples)]
    chunk = MAX_SLOTS + MAX_QUEUE  # what the server admits at once
    replies = [r for i in range(0, samples, chunk) for r in stream(server, requests[i: i + chunk])]
    outputs = torch.tensor([(tokens(r) + [EOS] * 3)[:3] for r in replies])  # [N, 3]; stopped at EOS: EOS
    for i in range(3):
        counts = torch.bincount(outputs[:, i], minlength=VOCAB).float()  # [V]
        assert chi_square_p_value(counts, marginals[i]) > 1e-3, f"token {i + 1}"
    assert sum(final(r)["total_accepted_draft_tokens"][0] for r in replies) > samples // 2
