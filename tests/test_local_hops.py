"""`triton-mtp export --hops local`: `spec_decode` runs the target and MTP workers in its own process.

The same drafting checkpoint is served both ways (conftest `spec_decode_repository` is the BLS
export); in fp32 on CPU every request, greedy or sampled with a seed, must come back identical, since
the workers and their draws are the same code with the same inputs, only not behind a hop.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from triton_mtp.client import Client, Delta, InvalidArgumentError
from triton_mtp.export.repository import write_repository

VOCAB = 128
STREAM_INTERVAL = 3
SPEC_DISABLE_ROWS = 2
DECODE_STEPS = 2


@pytest.fixture(scope="module")
def local_repository(drafting_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("local_hops_repository")
    write_repository(drafting_checkpoint, repo, max_slots=4, max_draft_tokens=4, hops="local", response_threads=2,
                     stream_interval=STREAM_INTERVAL, spec_disable_rows=SPEC_DISABLE_ROWS, decode_steps=DECODE_STEPS,
                     progress=False, log=lambda line: None)
    return repo  # every test here also sends from response threads, a response per STREAM_INTERVAL tokens, drafts
    # only in steps with at most SPEC_DISABLE_ROWS live requests and runs DECODE_STEPS target steps a call over
    # greedy rows without drafts


@pytest.fixture(scope="module")
def local(triton_server_for, local_repository):
    return Client(triton_server_for(local_repository).grpc_url, timeout=120)


@pytest.fixture(scope="module")
def bls(triton_server_for, spec_decode_repository):
    return Client(triton_server_for(spec_decode_repository).grpc_url, timeout=120)


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(1, 12, (count,), generator=gen)]


def test_the_repository_holds_spec_decode_alone_with_the_artifacts_inside(local_repository):
    assert sorted(p.name for p in local_repository.iterdir() if p.is_dir()) == ["spec_decode"]
    version = local_repository / "spec_decode" / "1"
    assert (version / "target" / "target.pt").is_file()
    assert sorted(p.name for p in (version / "mtp").glob("mtp_*.pt")) == ["mtp_0.pt", "mtp_1.pt"]
    config = (local_repository / "spec_decode" / "config.pbtxt").read_text()
    assert re.search(r'key: "hops", value: \{ string_value: "local" \}', config)
    assert re.search(r'key: "response_threads", value: \{ string_value: "2" \}', config)
    assert re.search(r'key: "response_lag_steps", value: \{ string_value: "0" \}', config)  # the export's default
    assert re.search(r'key: "stream_interval", value: \{ string_value: "3" \}', config)
    assert re.search(r'key: "spec_disable_rows", value: \{ string_value: "2" \}', config)
    assert re.search(r'key: "decode_steps", value: \{ string_value: "2" \}', config)
    assert re.search(r'key: "overlap", value: \{ string_value: "true" \}', config)
    assert re.search(r'key: "separate_prefill", value: \{ string_value: "true" \}', config)
    assert re.search(r'key: "switch_interval_us", value: \{ string_value: "100" \}', config)  # the export's default
    assert "kind: KIND_CPU" in config
    manifest = json.loads((local_repository / "export.json").read_text())
    assert manifest["hops"] == "local"
    assert manifest["artifacts"]["target"] == "spec_decode/1/target/target.pt"


def test_the_engine_runs_with_the_exported_thread_switch_interval(triton_server_for, local_repository):
    """`spec_decode` sets the switch interval its config gives (the export's default, 100 us) and says so, as it
    says how many target steps its calls over greedy rows without drafts run."""
    log_path = triton_server_for(local_repository).log_path
    deadline = time.monotonic() + 30
    for line in ("spec_decode: thread switch interval 100 us", "target: 2 steps a call over greedy rows without drafts"):
        while line not in log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"the stub did not log {line!r}"
            time.sleep(0.1)


def test_greedy_output_equals_the_bls_engine_for_every_k(local, bls):
    for k in range(5):  # k = 3, 4 reuse the two MTP layers cyclically
        for prompt in prompts(4, seed=k):
            ours = local.generate(input_ids=prompt, max_tokens=16, num_draft_tokens=k, return_logprobs=True)
            theirs = bls.generate(input_ids=prompt, max_tokens=16, num_draft_tokens=k, return_logprobs=True)
            assert ours.ids == theirs.ids, f"k={k} prompt={prompt}"
            assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
            assert ours.acceptance.accepted_per_position == theirs.acceptance.accepted_per_position
            if k and len(ours.ids) > 1:
                assert ours.acceptance.draft_tokens > 0


def test_sampled_output_with_a_seed_equals_the_bls_engine(local, bls):
    for i, prompt in enumerate(prompts(6, seed=10)):
        request = dict(input_ids=prompt, max_tokens=16, num_draft_tokens=1 + i % 4, temperature=(0.7, 1.0)[i % 2],
                       top_p=0.9, seed=500 + i)
        ours, theirs = local.generate(**request), bls.generate(**request)
        assert ours.ids == theirs.ids, request
        assert ours.acceptance.accepted_draft_tokens == theirs.acceptance.accepted_draft_tokens


def metric_values(metrics_url: str, *names: str) -> tuple[float, ...]:
    """The values of `names` (with their labels, or a metric's first series) from the server's metrics endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    labels = r"(?:\{[^}]*\})?"
    patterns = [rf"^{re.escape(name)}{'' if '{' in name else labels} (\S+)$" for name in names]
    return tuple(float(re.search(pattern, text, re.MULTILINE).group(1)) for pattern in patterns)


def chaining_counters(metrics_url: str) -> tuple[float, float]:
    """(chained target calls, calls launched ahead)."""
    return metric_values(metrics_url, "spec_decode_chained_calls", "spec_decode_calls_ahead")


def test_greedy_speculative_steps_chain_through_the_server_and_sampled_ones_do_not(triton_server_for, local_repository,
                                                                                    local):
    """A greedy request with drafts verifies and drafts in chained calls, launched ahead of the host; a sampled
    one drafts through the mtp hop (its draws come between the MTP calls), so it chains none."""
    metrics_url = triton_server_for(local_repository).metrics_url
    before = chaining_counters(metrics_url)
    outputs = [local.generate(input_ids=prompt, max_tokens=24, num_draft_tokens=2) for prompt in prompts(4, seed=0)]
    greedy = chaining_counters(metrics_url)
    for i, prompt in enumerate(prompts(4, seed=0)):
        local.generate(input_ids=prompt, max_tokens=24, num_draft_tokens=2, temperature=0.8, seed=i)
    sampled = chaining_counters(metrics_url)
    assert sum(len(o.ids) for o in outputs) >= 40, "outputs long enough to chain"
    assert greedy[0] - before[0] >= 10 and greedy[1] - before[1] >= 6, (before, greedy)
    assert sampled[0] == greedy[0], (greedy, sampled)


def test_a_plain_greedy_request_runs_decode_steps_tokens_a_call_through_the_server(triton_server_for, local_repository,
                                                                                  local, bls):
    """With `decode_steps` 2 a plain greedy request makes about half the target calls of one token a call (its prompt
    call, then a call per two tokens), and emits the BLS engine's tokens and logprobs."""
    metrics_url = triton_server_for(local_repository).metrics_url
    request = dict(input_ids=prompts(1, seed=40)[0], max_tokens=24, num_draft_tokens=0, return_logprobs=True)
    (before,) = metric_values(metrics_url, "spec_decode_hops")
    ours = local.generate(**request)
    (after,) = metric_values(metrics_url, "spec_decode_hops")  # flushed before the final response (metrics.finish)
    theirs = bls.generate(**request)
    assert ours.ids == theirs.ids and ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    assert len(ours.ids) >= 12, "an output long enough to count calls"
    assert after - before <= 1 + -(-(len(ours.ids) - 1) // DECODE_STEPS), (before, after, len(ours.ids))


def test_a_stream_left_early_is_cancelled_through_the_response_threads(triton_server_for, local_repository, local):
    """The response threads ask whether their requests were cancelled (the engine reads their answers): a stream
    left after its first response is dropped long before its max_tokens, and its slot is freed."""
    metrics_url = triton_server_for(local_repository).metrics_url
    cancelled = 'spec_decode_finished_requests{reason="cancelled"}'
    (before,) = metric_values(metrics_url, cancelled)
    max_seq_len = json.loads((local_repository / "export.json").read_text())["sizes"]["max_seq_len"]
    for _ in local.stream(input_ids=[9, 10], max_tokens=max_seq_len - 3, num_draft_tokens=0):
        break  # leaving the loop cancels the request on the server
    deadline = time.monotonic() + 60
    while metric_values(metrics_url, cancelled, "spec_decode_free_slots") != (before + 1, 4):
        assert time.monotonic() < deadline, "the stream left early was not dropped"
        time.sleep(0.05)
    assert local.generate(input_ids=[9, 10], max_tokens=3).finish_reason in ("length", "stop")


def test_concurrent_streams_equal_the_same_requests_one_by_one(local):
    """Together, most steps have more live requests than SPEC_DISABLE_ROWS and skip drafting: fewer drafts,
    the same tokens."""
    requests = [dict(input_ids=p, max_tokens=20, num_draft_tokens=1 + i % 4) for i, p in enumerate(prompts(8, seed=20))]
    alone = [local.generate(**r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda r: local.generate(**r), requests))
    assert [r.ids for r in together] == [r.ids for r in alone]
    drafted = [sum(r.acceptance.draft_tokens for r in results) for results in (together, alone)]
    assert drafted[0] < drafted[1], drafted


def test_streams_send_a_response_per_stream_interval_tokens_with_the_bls_engines_tokens(local, bls):
    for k, prompt in enumerate(prompts(3, seed=30)):
        request = dict(input_ids=prompt, max_tokens=17, num_draft_tokens=k, return_logprobs=True)
        ours = [item for item in local.stream(**request) if isinstance(item, Delta)]
        theirs = [item for item in bls.stream(**request) if isinstance(item, Delta)]
        assert [t for d in ours for t in d.ids] == [t for d in theirs for t in d.ids], f"k={k}"
        assert [p for d in ours for p in d.logprobs] == pytest.approx([p for d in theirs for p in d.logprobs], abs=1e-5)
        assert len(ours) < len(theirs) and len(ours[0].ids) == len(theirs[0].ids)
        assert all(len(d.ids) >= STREAM_INTERVAL for d in ours[1:-1]), [len(d.ids) for d in ours]


def test_bad_input_is_invalid_arg_and_the_engine_keeps_serving(local):
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        local.generate(input_ids=[5, 6], max_tokens=0)
    assert len(local.generate(input_ids=[5, 6], max_tokens=4, num_draft_tokens=2).ids) == 4


def test_local_hops_refuse_tensor_parallel(drafting_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--hops local.*--tensor-parallel 2"):
        write_repository(drafting_checkpoint, tmp_path, fmt="eager", hops="local", tensor_parallel=2, progress=False)
    with pytest.raises(ValueError, match="hops: must be one of bls, local"):
        write_repository(drafting_checkpoint, tmp_path, hops="inline", progress=False)
    with pytest.raises(ValueError, match="spec_disable_rows: must be >= 0, got -1"):
        write_repository(drafting_checkpoint, tmp_path, spec_disable_rows=-1, progress=False)
    with pytest.raises(ValueError, match="decode_steps: must be 1, or more with --hops local"):
        write_repository(drafting_checkpoint, tmp_path, decode_steps=2, progress=False)
