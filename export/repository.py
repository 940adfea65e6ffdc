"""Write a Triton model repository from a checkpoint (layout in docs/architecture.md).

    <repo>/target/config.pbtxt, 1/model.py, 1/target.<ext>
    <repo>/mtp/config.pbtxt, 1/model.py, 1/mtp_<i>.<ext>      (when the checkpoint has MTP layers)
    <repo>/spec_decode/config.pbtxt, 1/model.py, 1/tokenizer.json (when the checkpoint has one)
    <repo>/export.json

With hops "local" the engine runs the workers in its own process: only `spec_decode` is written, and
the artifacts go to spec_decode/1/target/ and spec_decode/1/mtp/.

The configs are the templates of `triton_mtp.model_repository` rendered with
`string.Template.substitute`; the adapters are copied. Every artifact passes the parity check
against eager before anything is rendered; a failing one leaves no model behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import string
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import triton_mtp.model_repository
from triton_mtp.export import compile_cache
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.config import ModelConfig
from triton_mtp.export.formats import HOPS
from triton_mtp.export.graphs import DTYPES, FORMATS, check_parity, export_graphs
from triton_mtp.export.kernel_choice import DEFAULT_DECODE_KERNELS, check_decode_kernels, choose_decode_kernels
from triton_mtp.export.moe import MOE_KINDS, default_moe_kind, grouped_mm_works
from triton_mtp.export.parallel import check_tensor_parallel
from triton_mtp.serving.graphs import compile_at_load
from triton_mtp.serving.requests import default_limits

TEMPLATES = Path(triton_mtp.model_repository.__file__).parent
MODELS = ("target", "mtp", "spec_decode")
DEVICES = ("cpu", "cuda")
# On cuda the eager format's modules replay their decode calls from CUDA graphs (serving/graphs.py);
# TorchScript steps cannot be captured. On cpu there are no graphs and TorchScript needs no checkpoint.
DEFAULT_FORMATS = {"cpu": "torchscript", "cuda": "eager"}
MANIFEST = "export.json"
# spec_decode's Python thread switch interval: its engine thread gives up the GIL at every torch call and waits
# for it while the response threads and request parsing run (docs/benchmarks.md, run 26's profile)
SWITCH_INTERVAL_US = 100


def write_repository(
    checkpoint_dir: str | Path,
    repo_dir: str | Path,
    fmt: str | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
    max_slots: int = 4,
    max_seq_len: int | None = None,
    max_draft_tokens: int = 4,
    default_num_draft_tokens: int | None = None,
    max_queue_size: int = 64,
    request_limits: dict[str, int | float] | None = None,
    eager_compile: bool = True,
    cuda_graphs: bool = True,
    compile_graphs: bool = False,
    prefill_graph_tokens: int = 256,
    decode_steps: int = 1,
    response_threads: int = 0,
    response_lag_steps: int = 0,
    stream_interval: int = 1,
    spec_disable_rows: int = 0,
    overlap: bool = True,
    separate_prefill: bool = True,
    switch_interval_us: int = SWITCH_INTERVAL_US,
    tensor_parallel: int = 1,
    hops: str = "bls",
    moe: str | None = None,
    decode_kernels: tuple[str, ...] = DEFAULT_DECODE_KERNELS,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Load the checkpoint, export and check its graphs, write the repository; returns the manifest.

    `fmt` defaults to `DEFAULT_FORMATS[device]`. `max_seq_len` defaults to the config's `max_position_embeddings`. `max_draft_tokens` bounds
    the verify window (k + 1 tokens); `default_num_draft_tokens` defaults to the number of MTP
    layers, capped by it. `request_limits` overrides `serving.requests.default_limits` (prompt bytes and
    tokens, max_tokens cap, request timeout). `cuda_graphs` lets the `target` and `mtp` models on CUDA
    replay decode-time calls from captured graphs (serving/graphs.py), captured over torch.compile'd steps
    with `compile_graphs`, and prompt calls of up to `prefill_graph_tokens` tokens too (0: prompts run
    eager). `decode_steps` N > 1 (local hops) lets a call over greedy rows without drafts run N target steps, one
    graph replay for N tokens of every row (multi-step decoding). `response_threads` > 0 makes `spec_decode` send
    streamed responses from that many threads (serving/responses.py), the engine waiting after each target call it
    reads for the responses queued `response_lag_steps` + 1 calls before; `stream_interval`, `spec_disable_rows`, `overlap` and
    `separate_prefill` are the scheduler's (serving/scheduler.py). `switch_interval_us` > 0 sets the
    Python thread switch interval of `spec_decode`'s process (`sys.setswitchinterval`; 0 keeps Python's 5 ms).
    `tensor_parallel` > 1 (eager format) makes the `target`
    and `mtp` models shard over that many ranks at load (serving/parallel.py). Existing `target`,
    `mtp`, `spec_decode` folders in `repo_dir` are replaced. `hops` "local" makes `spec_decode` run the
    target and MTP workers in its own process instead of calling the `target` and `mtp` models (no BLS
    hop per call; one rank only), and writes `spec_decode` alone. `moe` is how the routed experts run
    (export/moe.py): the eager format defaults to "grouped" on CUDA where grouped_mm runs for the
    dtype, else "dense"; the graph formats are "dense". `decode_kernels` names the decode paths the eager
    format's models send through Triton kernels where those run (export/kernel_choice.py).
    """
    fmt = DEFAULT_FORMATS.get(device) if fmt is None else fmt  # an unknown device is reported first
    _check_settings(fmt, device, dtype, max_slots, max_seq_len, max_draft_tokens, max_queue_size)
    checkpoint_dir, repo = Path(checkpoint_dir), Path(repo_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint: {checkpoint_dir} is not a directory")
    if hops not in HOPS:
        raise ValueError(f"hops: must be one of {', '.join(HOPS)}, got {hops!r}")
    if spec_disable_rows < 0:
        raise ValueError(f"spec_disable_rows: must be >= 0, got {spec_disable_rows}")
    if prefill_graph_tokens < 0:
        raise ValueError(f"prefill_graph_tokens: must be >= 0, got {prefill_graph_tokens}")
    if decode_steps < 1 or decode_steps > 1 and hops != "local":
        raise ValueError(f"decode_steps: must be 1, or more with --hops local (the engine's own workers), "
                         f"got {decode_steps} with hops {hops}")
    if switch_interval_us < 0:
        raise ValueError(f"switch_interval_us: must be >= 0, got {switch_interval_us}")
    if hops == "local" and tensor_parallel > 1:
        raise ValueError(f"--hops local: runs one rank in spec_decode's process, got --tensor-parallel {tensor_parallel}")
    if tensor_parallel > 1 and fmt != "eager":
        raise ValueError(f"--tensor-parallel {tensor_parallel}: needs --format eager (shards are cut at load), got {fmt}")
    check_tensor_parallel(ModelConfig.from_checkpoint(checkpoint_dir), tensor_parallel)
    compiles = _compiles_at_load(fmt, device, cuda_graphs, compile_graphs, eager_compile, tensor_parallel)
    moe = _moe_kind(fmt, device, dtype, moe, compiles)
    decode_kernels = check_decode_kernels(decode_kernels)
    config, target, mtp = load_checkpoint(checkpoint_dir, dtype, device, max_slots, max_seq_len, progress=progress,
                                          moe=moe)
    choose_decode_kernels(decode_kernels, target, mtp)  # the parity check and the compile cache run them as served
    max_seq_len = target.max_seq_len
    if max_draft_tokens + 3 > max_seq_len:
        raise ValueError(f"max_seq_len: {max_seq_len} leaves no room for a verify window of {max_draft_tokens + 1} tokens")
    num_mtp_layers = config.num_nextn_predict_layers if mtp is not None else 0
    if default_num_draft_tokens is None:
        default_num_draft_tokens = min(max_draft_tokens, num_mtp_layers)
    if not 0 <= default_num_draft_tokens <= max_draft_tokens:
        raise ValueError(
            f"default_num_draft_tokens: must be in [0, max_draft_tokens={max_draft_tokens}], got {default_num_draft_tokens}"
        )

    for name in MODELS:
        shutil.rmtree(repo / name, ignore_errors=True)
    (repo / MANIFEST).unlink(missing_ok=True)
    artifact_dirs = {"bls": (repo / "target" / "1", repo / "mtp" / "1"),
                     "local": (repo / "spec_decode" / "1" / "target", repo / "spec_decode" / "1" / "mtp")}[hops]
    try:
        with tqdm(total=1 + num_mtp_layers, desc=f"exporting {fmt}", unit="graph", disable=not progress) as bar:
            artifacts = export_graphs(
                target, mtp, artifact_dirs[0], fmt, mtp_dir=artifact_dirs[1],
                checkpoint_dir=checkpoint_dir, dtype=dtype, eager_compile=eager_compile, moe=moe,
                decode_kernels=decode_kernels, on_saved=lambda name: bar.update(1),
            )
        with compile_cache.filling(list(artifact_dirs)) if compiles else contextlib.nullcontext():
            parity = check_parity(target, mtp, artifacts, fmt, verify_tokens=max_draft_tokens + 1, log=log,
                                  compile=compiles if fmt == "eager" else None)
    except BaseException:
        for name in MODELS:
            shutil.rmtree(repo / name, ignore_errors=True)
        raise

    values = {
        "kind": ("KIND_MODEL" if tensor_parallel > 1 else "KIND_GPU") if device == "cuda" else "KIND_CPU",
        "hops": hops,
        "format": fmt,
        "device": device,
        "dtype": dtype,
        "max_slots": max_slots,
        "max_seq_len": max_seq_len,
        "max_draft_tokens": max_draft_tokens,
        "num_mtp_layers": num_mtp_layers,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "eos_token_id": _eos_token_id(config),
        "default_num_draft_tokens": default_num_draft_tokens,
        "max_queue_size": max_queue_size,
        "tensor_parallel_size": tensor_parallel,
        "cuda_graphs": "true" if cuda_graphs else "false",
        "compile_graphs": "true" if compile_graphs else "false",
        "prefill_graph_tokens": prefill_graph_tokens,
        "decode_steps": decode_steps,
        "response_threads": response_threads,
        "response_lag_steps": response_lag_steps,
        "stream_interval": stream_interval,
        "spec_disable_rows": spec_disable_rows,
        "overlap": "true" if overlap else "false",
        "separate_prefill": "true" if separate_prefill else "false",
        "switch_interval_us": switch_interval_us,
        **_request_limits(max_seq_len, request_limits or {}),
    }
    values["spec_decode_kind"] = values["kind"] if hops == "local" else "KIND_CPU"  # a BLS engine holds no weights
    for name in MODELS:
        if (name == "mtp" and mtp is None) or (hops == "local" and name != "spec_decode"):
            continue
        _install_model(name, repo, values)
    tokenizer = checkpoint_dir / "tokenizer.json"
    if tokenizer.is_file():
        (repo / "spec_decode" / "1").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, repo / "spec_decode" / "1" / "tokenizer.json")

    manifest = {
        "format": fmt,
        "dtype": dtype,
        "device": device,
        "tensor_parallel_size": tensor_parallel,
        "hops": hops,
        "compile_graphs": compile_graphs,
        "moe": moe,
        "decode_kernels": list(decode_kernels),
        "checkpoint": str(checkpoint_dir.resolve()),
        "torch_version": torch.__version__,
        "sizes": {k: values[k] for k in ("max_slots", "max_seq_len", "max_draft_tokens", "default_num_draft_tokens",
                                         "max_queue_size", "num_mtp_layers")},
        "model_config": config.to_dict(),
        "artifacts": {name: str(path.relative_to(repo)) for name, path in artifacts.items()},
        "parity_max_relative_error": parity,
    }
    (repo / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _check_settings(
    fmt: str, device: str, dtype: str, max_slots: int, max_seq_len: int | None, max_draft_tokens: int, max_queue_size: int
) -> None:
    """One-line ValueError naming the first bad setting."""
    if device not in DEVICES:
        raise ValueError(f"device: must be cpu or cuda, got {device!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but this host has no CUDA device")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for name, value, low in (("max_slots", max_slots, 1), ("max_draft_tokens", max_draft_tokens, 1),
                             ("max_queue_size", max_queue_size, 1), ("max_seq_len", max_seq_len, 4)):
        if value is not None and value < low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")


def _request_limits(max_seq_len: int, overrides: dict[str, int | float]) -> dict[str, int | float]:
    """The `spec_decode` request limits: the defaults for `max_seq_len` with `overrides` checked and applied."""
    limits = default_limits(max_seq_len)
    for name, value in overrides.items():
        if name not in limits:
            raise ValueError(f"{name}: not a request limit (expected one of {', '.join(limits)})")
        if value is None:
            continue
        if not 0 <= value < float("inf") or (value == 0 and name != "request_timeout_s"):
            raise ValueError(f"{name}: must be a finite number > 0, got {value}")
        limits[name] = value
    for name in ("max_prompt_tokens", "max_output_tokens"):
        if limits[name] >= max_seq_len:
            raise ValueError(f"{name}: {limits[name]} leaves no room in max_seq_len {max_seq_len}")
    return limits


def _moe_kind(fmt: str, device: str, dtype: str, moe: str | None, compiles: bool) -> str:
    """The MoE kind to export: `moe` checked against the format, device and compilation, or the default."""
    if moe is not None and moe not in MOE_KINDS:
        raise ValueError(f"moe: must be one of {', '.join(MOE_KINDS)}, got {moe!r}")
    if fmt != "eager":
        if moe == "grouped":
            raise ValueError(f"moe: grouped needs --format eager (the {fmt} graphs export the dense MoE)")
        return "dense"
    if moe is None:
        return default_moe_kind(torch.device(device), DTYPES[dtype])
    if moe == "grouped" and not grouped_mm_works(torch.device(device), DTYPES[dtype]):
        raise ValueError(f"moe: grouped needs torch.nn.functional.grouped_mm for {dtype} on {device} "
                         "(bf16 on CUDA sm90+); use --moe dense")
    if moe == "grouped" and compiles and dtype != "bf16":
        raise ValueError(f"moe: grouped steps compile only in bf16 (torch.compile's grouped_mm), got {dtype}; "
                         "use --dtype bf16, --no-compile or --moe dense")
    return moe


def _compiles_at_load(fmt: str, device: str, cuda_graphs: bool, compile_graphs: bool, eager_compile: bool,
                      tensor_parallel: int) -> bool:
    """Whether the served `target` / `mtp` models compile their steps at load (eager format, one rank).
    Then the parity check compiles the same steps, and their cache ships with the artifacts."""
    if fmt != "eager" or tensor_parallel > 1:
        return False
    params = {"format": fmt, "cuda_graphs": "true" if cuda_graphs else "false",
              "compile_graphs": "true" if compile_graphs else "false"}
    choice = compile_at_load(params, torch.device(device), tensor_parallel)
    return eager_compile if choice is None else choice


def _eos_token_id(config: ModelConfig) -> int:
    """The first end-of-sequence id, or -1 when the config names none."""
    eos = config.eos_token_id
    if isinstance(eos, list):
        return int(eos[0]) if eos else -1
    return -1 if eos is None else int(eos)


def _install_model(name: str, repo: Path, values: dict[str, Any]) -> None:
    """Render `<name>/config.pbtxt` and copy `<name>/1/model.py`; a missing template is skipped with a warning."""
    template = TEMPLATES / name / "config.pbtxt"
    adapter = TEMPLATES / name / "1" / "model.py"
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    if template.is_file():
        (repo / name / "config.pbtxt").write_text(render(template, values))
    else:
        warnings.warn(f"{template}: template not found, {name}/config.pbtxt not written", stacklevel=3)
    if adapter.is_file():
        shutil.copyfile(adapter, repo / name / "1" / "model.py")
    else:
        warnings.warn(f"{adapter}: adapter not found, {name}/1/model.py not written", stacklevel=3)


def render(template: Path, values: dict[str, Any]) -> str:
    """`string.Template.substitute`; an unknown placeholder is a ValueError naming the file and key."""
    try:
        return string.Template(template.read_text()).substitute({k: str(v) for k, v in values.items()})
    except KeyError as exc:
        raise ValueError(f"{template}: unknown placeholder ${{{exc.args[0]}}}") from None
    except ValueError as exc:
        raise ValueError(f"{template}: {exc}") from None
