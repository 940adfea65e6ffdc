"""A tensor-parallel step: rank 0 in the calling process, ranks 1..W-1 in worker processes.

The `target` / `mtp` model (a Triton Python-backend instance) holds a `TensorParallelStep` where it
would hold a single-process runner; the step signature is the same (docs/architecture.md). Each
call, rank 0 broadcasts a header (operation, MTP layer, then dtype and shape of each input) and then
the inputs; every rank runs its shard (export/parallel.py), whose collectives join the ranks' partial
results, and rank 0 returns (logits, hidden). Ranks are processes started with
`torch.multiprocessing` (spawn), one per device: `cuda:<rank>` over NCCL, or the CPU over gloo.

Failure handling: a worker reports its exception through a pipe and exits; rank 0 raises a
RuntimeError naming the rank (gloo notices the closed peer at once; NCCL only after the process
group's timeout). Workers also exit when rank 0's process dies. After a failure or `close()` the
step refuses calls.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from triton_mtp.export.graphs import StepRunner, load_step
from triton_mtp.serving.requests import int_parameter

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Build = Callable[[int, int, torch.device], Step]  # (rank, world_size, device) -> the rank's step

STOP, STEP, RESET = 0, 1, 2
CODES = (torch.int64, torch.float32, torch.bfloat16, torch.float16)  # dtype <-> header code
MAX_INPUTS, MAX_DIMS = 4, 3
FIELDS = 2 + MAX_DIMS  # per input: dtype code, ndim, dims (zero-padded)
HEADER = 3 + MAX_INPUTS * FIELDS  # operation, layer (-1: none), number of inputs, then the inputs
TIMEOUT_S = 1800.0  # loading a rank's shard; also the process group's collective timeout
JOIN_TIMEOUT_S = 10.0
FAILURE_GRACE_S = 5.0  # how long a failed call waits for a worker's own error report


def tensor_parallel_size(params: Mapping[str, str], device: torch.device) -> int:
    """config.pbtxt parameter `tensor_parallel_size` (1 when absent), checked at load time.

    Whether it divides the model's sizes is checked by the shard itself, before the checkpoint loads.
    """
    if "tensor_parallel_size" not in params:
        return 1
    size = int_parameter(params, "tensor_parallel_size", 1)
    if size > 1 and params.get("format") != "eager":
        raise ValueError(
            f"config.pbtxt: parameter 'tensor_parallel_size' {size} needs format eager, got {params.get('format')!r}"
        )
    if size > 1 and device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"config.pbtxt: parameter 'tensor_parallel_size' is {size} but {torch.cuda.device_count()} "
            "CUDA devices are visible"
        )
    return size


def load_parallel_step(
    path: str | Path,
    fmt: str,
    device: str | torch.device,
    world_size: int = 1,
    *,
    compile: bool | None = None,
    timeout_s: float = TIMEOUT_S,
) -> StepRunner | TensorParallelStep:
    """`export.graphs.load_step` for world_size 1; else the eager artifacts sharded over world_size ranks."""
    if world_size == 1:
        return load_step(path, fmt, device, compile=compile)
    return TensorParallelStep(functools.partial(_load_rank, Path(path), fmt, compile), world_size, device, timeout_s)


def _load_rank(path: Path, fmt: str, compile: bool | None, rank: int, world_size: int, device: torch.device) -> Step:
    return load_step(path, fmt, device, compile=compile, rank=rank, world_size=world_size)


class TensorParallelStep:
    """A step run on `world_size` ranks; called like the step `build` returns, on rank 0's device.

    `build(rank, world_size, device)` runs on every rank once the default process group is up and
    returns that rank's step (a `StepRunner` of the rank's shard); it must pickle (a module-level
    function or a partial of one). One per process: it owns the default process group.
    """

    def __init__(self, build: Build, world_size: int, device: str | torch.device = "cpu",
                 timeout_s: float = TIMEOUT_S) -> None:
        if world_size < 2:
            raise ValueError(f"tensor_parallel_size: a TensorParallelStep needs >= 2 ranks, got {world_size}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized: one TensorParallelStep per process")
        self.world_size = world_size
        self.device = _rank_device(torch.device(device).type, 0)
        self._closed, self._serving, self._reason = False, False, ""
        self._errors: dict[int, str] = {}  # rank -> its reported error, or how it exited
        store = _store(0, world_size, 0, timeout_s)  # binds a free port now: nothing can take it meanwhile
        if self.device.type == "cuda":
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (SHARP); spawned ranks inherit it
        ctx = mp.get_context("spawn")
        ctx.set_executable(_python())
        self._processes, self._conns = [], []
        self._stop = weakref.finalize(self, _stop_processes, self._processes, 0.0)  # never closed: terminate
        for rank in range(1, world_size):
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_worker, name=f"tensor-parallel-rank-{rank}",
                args=(build, rank, world_size, store.port, self.device.type, timeout_s, os.getpid(), send),
            )
            process.start()
            send.close()
            self._processes.append(process)
            self._conns.append(receive)
        try:
            self._expect("started", timeout_s)
            _init_group(store, 0, world_size, self.device, timeout_s)
            self.step = build(0, world_size, self.device)
            self._expect("ready", timeout_s)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._serving = True

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..W-1."""
        return [p.pid for p in self._processes]

    def __call__(self, *inputs: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own arguments: tensors, then the MTP's `layer` for an MTP step."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        layer = inputs[-1] if len(tensors) < len(inputs) else -1
        return self._run(STEP, tensors, int(layer), lambda: self.step(*inputs))

    def reset_cache(self) -> None:
        """Zero every rank's KV pool."""
        self._run(RESET, [], -1, self.step.reset_cache)

    def close(self) -> None:
        """Stop the workers (a stop message, then join; terminate what has not exited) and leave the group."""
        if self._closed:
            return
        self._closed = True
        self._stop.detach()
        clean = self._serving and not self._reason  # else loading, or after a failure: nothing to finish
        if clean:
            with contextlib.suppress(RuntimeError):  # a broken group: the workers are terminated below
                _broadcast(STOP, [], -1, self.device)
        self._reason = self._reason or "closed"
        _stop_processes(self._processes, JOIN_TIMEOUT_S if clean else 0.0)
        for conn in self._conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _run(self, op: int, tensors: list[torch.Tensor], layer: int, local: Callable):
        if self._closed:
            raise RuntimeError(f"tensor-parallel step: unusable ({self._reason})")
        dead = [rank for rank, p in enumerate(self._processes, start=1) if not p.is_alive()]
        try:
            if dead:
                raise RuntimeError(f"tensor-parallel rank {dead[0]}: exited")
            _broadcast(op, tensors, layer, self.device)
            return local()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Close after `exc` on rank 0; raise the first worker's error in its place when there is one."""
        failure = self._failure()
        self._reason = failure or f"{type(exc).__name__}: {exc}"
        self.close()
        if failure is not None:
            raise RuntimeError(failure) from exc

    def _expect(self, state: str, timeout_s: float) -> None:
        """Wait until every worker reports `state`; RuntimeError naming the first that failed or exited."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, self.world_size))
        while pending and not self._errors:
            handles = [h for r in pending for h in (self._conns[r - 1], self._processes[r - 1].sentinel)]
            if not wait(handles, timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending)}: not {state} after {timeout_s:.0f} s")
            pending -= {rank for rank in pending if self._report(rank) == state}
        if self._errors:
            raise RuntimeError(self._failure())

    def _failure(self) -> str | None:
        """The first worker error or exit, given FAILURE_GRACE_S to show up; None when none did."""
        if not self._errors:
            wait([h for conn, p in zip(self._conns, self._processes) for h in (conn, p.sentinel)], FAILURE_GRACE_S)
            for rank in range(1, self.world_size):
                self._report(rank)
        if not self._errors:
            return None
        rank = min(self._errors)
        return f"tensor-parallel rank {rank}: {self._errors[rank]}"

    def _report(self, rank: int) -> str | None:
        """Rank's next progress report ("started", "ready") or None; errors and exits go to `_errors`."""
        conn, process = self._conns[rank - 1], self._processes[rank - 1]
        try:
            if conn.poll():
                kind, text = conn.recv()
                if kind != "error":
                    return kind
                self._errors.setdefault(rank, text)
                return None
        except (EOFError, OSError):
            pass
        if not process.is_alive():
            process.join()
            self._errors.setdefault(rank, f"exited with code {process.exitcode}")
        return None


def _worker(build: Build, rank: int, world_size: int, port: int, device_type: str, timeout_s: float,
            parent_pid: int, conn: Connection) -> None:
    """Rank `rank`: join the group, build the shard, then run each step rank 0 broadcasts until STOP."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    conn.send(("started", ""))
    try:
        device = _rank_device(device_type, rank)
        _init_group(_store(rank, world_size, port, timeout_s), rank, world_size, device, timeout_s)
        step = build(rank, world_size, device)
        conn.send(("ready", ""))
        while True:
            op, tensors, layer = _receive(device)
            if op == STOP:
                break
            if op == RESET:
                step.reset_cache()
            else:
                step(*tensors, *([layer] if layer >= 0 else []))
    except BaseException as exc:
        with contextlib.suppress(OSError):  # rank 0 may be gone
            conn.send(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
        os._exit(1)  # skip the process group's teardown: its peers may be gone
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this worker once rank 0's process is gone (a blocked collective would wait forever)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _stop_processes(processes: list, grace_s: float) -> None:
    """Join the workers; terminate, then kill, those still running after `grace_s`."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for signal in ("terminate", "kill"):
        for process in processes:
            if process.is_alive():
                getattr(process, signal)()
                process.join(JOIN_TIMEOUT_S)


def _store(rank: int, world_size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous on 127.0.0.1: rank 0 serves it (port 0: any free one), the others connect to `port`."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _init_group(store: dist.TCPStore, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _rank_device(device_type: str, rank: int) -> torch.device:
    """cuda:<rank> (one GPU per rank), or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _python() -> str:
    """This environment's interpreter, also inside a Triton backend stub (whose sys.executable is the stub)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = shutil.which(version) or shutil.which("python3")
    if found is None:
        raise RuntimeError(f"tensor parallelism: no {version} on PATH to start the ranks with")
    return found


def _broadcast(op: int, tensors: list[torch.Tensor], layer: int, device: torch.device) -> None:
    """Rank 0: the header, then each input."""
    if len(tensors) > MAX_INPUTS or any(t.dim() > MAX_DIMS for t in tensors):
        raise ValueError(f"tensor-parallel step: at most {MAX_INPUTS} inputs of at most {MAX_DIMS} dims")
    values = [op, layer, len(tensors)]
    for t in tensors:
        values += [CODES.index(t.dtype), t.dim(), *t.shape, *[0] * (MAX_DIMS - t.dim())]
    header = torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64, device=device)  # [HEADER]
    dist.broadcast(header, src=0)
    for t in tensors:
        dist.broadcast(t.contiguous(), src=0)


def _receive(device: torch.device) -> tuple[int, list[torch.Tensor], int]:
    """Ranks 1..W-1: (operation, inputs, layer) as rank 0 broadcast them."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)  # [HEADER]
    dist.broadcast(header, src=0)
    op, layer, count, *fields = header.tolist()
    tensors = []
    for i in range(count):
        code, ndim, *dims = fields[i * FIELDS : (i + 1) * FIELDS]
        tensor = torch.empty(dims[:ndim], dtype=CODES[code], device=device)
        dist.broadcast(tensor, src=0)
        tensors.append(tensor)
    return op, tensors, layer
