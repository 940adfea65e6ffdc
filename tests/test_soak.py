"""A short soak (200 streamed requests, 32 concurrent streams) against a real server; `bench/soak.py`
runs the long one. Mixed k, temperatures, seeds and cancellations; every output is checked."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.soak import (
    check, export, greedy_references, mixed_requests, prompt_pool, repository_limits, run_streams, server_rss_bytes,
    wait_for_idle,
)

REQUESTS = 200
CONCURRENCY = 32


def reliability_repository(base: Path, checkpoint: Path) -> Path:
    """The tiny drafting model with a word-level tokenizer (token i is `t<i>`), exported once per run.

    tests/test_fuzz.py builds the same path, so both modules share one server.
    """
    repository = base / "reliability_repository"
    if not (repository / "spec_decode" / "config.pbtxt").is_file():
        source = base / "reliability_checkpoint"
        shutil.copytree(checkpoint, source, dirs_exist_ok=True)
        vocab = repository_vocab(source)
        tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(source / "tokenizer.json"))
        export(source, repository, max_slots=8, max_queue=64, max_seq_len=64)
    return repository


def repository_vocab(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def server(triton_server_for, drafting_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    return triton_server_for(reliability_repository(tmp_path_factory.getbasetemp(), drafting_checkpoint))


def test_soak_of_mixed_streams_loses_no_token_and_leaks_no_slot(server) -> None:
    limits = repository_limits(server.repository)
    tokenizer = Tokenizer.from_file(str(server.repository / "spec_decode" / "1" / "tokenizer.json"))
    pool = prompt_pool(12, limits["vocab_size"], limits["max_seq_len"], random.Random(7))
    mix = mixed_requests(REQUESTS, pool, limits["max_draft_tokens"], seed=7)
    references = greedy_references(server.grpc_url, pool)
    rss_before = server_rss_bytes(server.process.pid)

    results = run_streams(server.grpc_url, mix, CONCURRENCY)

    assert len(results) == REQUESTS
    assert check(results, references, lambda ids: tokenizer.decode(ids)) == {}
    kinds = {kind: [r for r in results if r.request.kind == kind] for kind in ("greedy", "seeded", "cancelled")}
    assert all(kinds.values()), {kind: len(rs) for kind, rs in kinds.items()}
    assert sum(r.cancelled for r in kinds["cancelled"]) > len(kinds["cancelled"]) // 2
    assert any(len(r.deltas) > 2 for r in kinds["greedy"]), "greedy streams should send one response per step"
    assert any(r.request.num_draft_tokens and r.final["total_accepted_draft_tokens"][0] > 0 for r in kinds["greedy"])

    gauges = wait_for_idle(server.metrics_url, limits["max_slots"])
    assert gauges == {"spec_decode_free_slots": limits["max_slots"], "spec_decode_live_sequences": 0,
                      "spec_decode_waiting_requests": 0}
    assert server_rss_bytes(server.process.pid) < 2 * rss_before
