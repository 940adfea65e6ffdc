"""Tensor parallelism over two CPU ranks (gloo) reproduces the single-process steps; workers end cleanly.

The ranks are a `TensorParallelStep`: rank 0 in the test process, rank 1 a spawned worker. The tiny
config's head count (4), intermediate sizes (96, 32), expert count (8) and vocabulary (128) all
divide by two. The last test serves an eager `--tensor-parallel 2` repository with tritonserver.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference import greedy_completion
from tiny_config import tiny_config
from triton_mtp.cli import main
from triton_mtp.client import Client
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.graphs import export_graphs
from triton_mtp.export.parallel import check_tensor_parallel
from triton_mtp.export.synthetic import write_checkpoint
from triton_mtp.serving.parallel import TensorParallelStep, load_parallel_step, tensor_parallel_size

MAX_SLOTS, MAX_SEQ_LEN = 3, 24
TIMEOUT_S = 120.0

# (positions, slot_ids) per call: a prefill of two rows (the second padded), one-token decodes, a
# verify window, then a rollback: row 0 rewrites positions 6 and 7 with other tokens.
CALLS = [
    (torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]), torch.tensor([2, 0])),
    (torch.tensor([[5], [3]]), torch.tensor([2, 0])),
    (torch.tensor([[6, 7, 8], [4, 5, 6]]), torch.tensor([2, 0])),
    (torch.tensor([[6, 7], [7, -1]]), torch.tensor([2, 0])),
    (torch.tensor([[8]]), torch.tensor([2])),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tp_checkpoint"), tiny_config())


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    """(target, mtp, eager artifact dir) of the tiny checkpoint, loaded in this process."""
    _, target, mtp = load_checkpoint(checkpoint, "fp32", "cpu", MAX_SLOTS, MAX_SEQ_LEN, progress=False)
    artifacts = tmp_path_factory.mktemp("tp_artifacts")
    export_graphs(target, mtp, artifacts, "eager", checkpoint_dir=checkpoint, dtype="fp32", eager_compile=False)
    return target, mtp, artifacts


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def replay(single, parallel, with_hidden: bool) -> None:
    """Run CALLS through both; logits and hidden at valid positions agree within 1e-5 relative."""
    gen = torch.Generator().manual_seed(0)
    single.reset_cache()
    parallel.reset_cache()
    for i, (positions, slot_ids) in enumerate(CALLS):
        token_ids = torch.randint(0, 128, tuple(positions.shape), generator=gen)  # [B, T]
        inputs = (token_ids, positions, slot_ids)
        if with_hidden:
            hidden = torch.randn(*positions.shape, 64, generator=gen)  # [B, T, H]
            inputs = (token_ids, hidden, positions, slot_ids, i % 2)  # alternate MTP layers
        with torch.no_grad():
            expected, got = single(*inputs), parallel(*inputs)
        valid = positions >= 0  # [B, T]
        for e, g in zip(expected, got):
            assert g.shape == e.shape
            assert relative_error(g[valid], e[valid]) <= 1e-5, f"call {i}"


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    except FileNotFoundError:
        return False


def assert_exited(pids: list[int]) -> None:
    assert pids and not any(running(pid) for pid in pids)


def test_target_over_two_ranks_matches_one_process(models):
    target, _, artifacts = models
    step = load_parallel_step(artifacts / "target.json", "eager", "cpu", 2, timeout_s=TIMEOUT_S)
    shard = step.step.graphs[0].module  # rank 0's DeepseekV3Target
    assert shard.model.layers[0].self_attn.num_heads == 2 and len(shard.model.layers[1].mlp.experts) == 4
    assert shard.lm_head.weight.shape == (64, 64)  # [V/2, H]
    try:
        replay(target, step, with_hidden=False)
    finally:
        step.close()
    assert_exited(step.pids)
    assert not dist.is_initialized()


def test_mtp_over_two_ranks_matches_one_process(models):
    _, mtp, artifacts = models
    step = load_parallel_step(artifacts / "mtp_0.json", "eager", "cpu", 2, timeout_s=TIMEOUT_S)
    try:
        replay(mtp, step, with_hidden=True)
    finally:
        step.close()
    assert_exited(step.pids)


def test_sizes_that_do_not_divide_fail_with_one_line(models):
    config = models[0].config
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 3 does not divide num_attention_heads \(4\)$"):
        check_tensor_parallel(config, 3)
    odd_experts = ModelConfig.from_dict({**tiny_config(), "n_routed_experts": 6, "n_group": 1, "topk_group": 1})
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 4 does not divide n_routed_experts \(6\)$"):
        check_tensor_parallel(odd_experts, 4)


@pytest.mark.parametrize(
    "params, device, message",
    [
        ({"format": "eager", "tensor_parallel_size": "0"}, "cpu", ">= 1, got 0"),
        ({"format": "torchscript", "tensor_parallel_size": "2"}, "cpu", "needs format eager, got 'torchscript'"),
        ({"format": "eager", "tensor_parallel_size": "64"}, "cuda", "is 64 but"),
    ],
)
def test_config_parameter_is_checked_at_load(params, device, message):
    with pytest.raises(ValueError, match="^config.pbtxt: parameter 'tensor_parallel_size' .*" + message):
        tensor_parallel_size(params, torch.device(device))
    assert tensor_parallel_size({"format": "torchscript"}, torch.device("cpu")) == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-parallel", "3", "--format", "eager"],
         "tensor_parallel_size: 3 does not divide num_attention_heads (4)"),
        (["--tensor-parallel", "2"], "--tensor-parallel 2: needs --format eager"),
    ],
)
def test_export_rejects_bad_tensor_parallel_with_one_line(checkpoint, tmp_path, flags, message, capsys):
    assert main(["export", "--checkpoint", str(checkpoint), "--repository", str(tmp_path), *flags]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"triton-mtp export: error: {message}")
    assert not (tmp_path / "target").exists()


class AllReduceStep:
    """Every rank sums its input over the group; rank 1 raises on a negative input."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rank == 1 and bool((x < 0).any()):
            raise ValueError("negative input on rank 1")
        total = x.clone()
        dist.all_reduce(total)
        return total, total


def build_all_reduce(rank: int, world_size: int, device: torch.device) -> AllReduceStep:
    return AllReduceStep(rank)


def build_failing(rank: int, world_size: int, device: torch.device) -> AllReduceStep:
    if rank == 1:
        raise ValueError("no shard for rank 1")
    return AllReduceStep(rank)


def test_worker_error_in_a_step_raises_on_rank_0():
    step = TensorParallelStep(build_all_reduce, 2, "cpu", timeout_s=TIMEOUT_S)
    assert torch.equal(step(torch.ones(3))[0], torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="^tensor-parallel rank 1: ValueError: negative input on rank 1$"):
        step(-torch.ones(3))
    assert_exited(step.pids)
    with pytest.raises(RuntimeError, match="unusable"):
        step(torch.ones(3))


def test_workers_exit_when_rank_0_dies():
    script = ("import time; from test_tensor_parallel import build_all_reduce; "
              "from triton_mtp.serving.parallel import TensorParallelStep; "
              "step = TensorParallelStep(build_all_reduce, 3); print(*step.pids, flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    rank_0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(pid) for pid in rank_0.stdout.readline().split()]
    finally:
        rank_0.kill()
        rank_0.wait()
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_exited(pids)


def test_worker_error_while_loading_raises_on_rank_0():
    with pytest.raises(RuntimeError, match="^tensor-parallel rank 1: ValueError: no shard for rank 1$"):
        TensorParallelStep(build_failing, 2, "cpu", timeout_s=TIMEOUT_S)
    assert not mp.active_children()
    assert not dist.is_initialized()


def test_served_tensor_parallel_repository_completes_like_greedy_eager(models, checkpoint, tmp_path_factory,
                                                                        triton_server_for):
    repository = tmp_path_factory.mktemp("tp_repository")
    assert main(["export", "--checkpoint", str(checkpoint), "--repository", str(repository), "--format", "eager",
                 "--no-compile", "--tensor-parallel", "2", "--max-slots", str(MAX_SLOTS),
                 "--max-seq-len", str(MAX_SEQ_LEN)]) == 0
    for name in ("target", "mtp"):
        config = (repository / name / "config.pbtxt").read_text()
        assert 'key: "tensor_parallel_size", value: { string_value: "2" }' in config
    server = triton_server_for(repository)
    prompt = [5, 6, 7, 8, 9]
    with Client(server.grpc_url, timeout=120) as client:
        completion = client.generate(input_ids=prompt, max_tokens=8)
    assert completion.ids == greedy_completion(models[0], prompt, 8)
