"""Everything that touches `triton_python_backend_utils`: tensors in and out, BLS hops, responses
and metrics. The engine modules stay importable (and testable) without a server.
"""
from __future__ import annotations

import functools
import json
import locale
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from triton_mtp.export import compile_cache
from triton_mtp.export.formats import DTYPES, FORMATS, HOPS
from triton_mtp.serving import graphs, parallel
from triton_mtp.serving.metrics import COUNTERS, GAUGES
from triton_mtp.serving.requests import (
    EngineLimits, GenerationResponse, QueueFull, RequestError, Tokenizer, int_parameter, parse_request,
)
from triton_mtp.serving.workers import (
    DraftBatch, DraftResult, DraftWorker, InProcessHops, PendingTarget, TargetBatch, TargetResult, TargetWorker,
    draft_chain, multi_step, verify_window,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# `request.is_cancelled()` is a round trip from the stub to the server (as is every metric update): the
# scheduler asks every live request at most this often rather than every step.
CANCEL_CHECK_INTERVAL_S = 0.05


def model_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt `parameters` of the model being initialized, as strings."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def read_inputs(request) -> dict[str, np.ndarray]:
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def _response(arrays: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, a) for name, a in arrays.items()])


def _error(message: str, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def serve(request, compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]):
    """Response for one request of a non-decoupled model; an exception becomes its error response."""
    try:
        return _response(compute(read_inputs(request)))
    except ValueError as exc:
        return _error(str(exc), pb_utils.TritonError.INVALID_ARG)
    except Exception as exc:  # noqa: BLE001 - reported to this request only
        return _error(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)


class ResponseSender:
    """A decoupled request's response sender, as the scheduler's ResponseHandle."""

    def __init__(self, request) -> None:
        self._request = request
        self._sender = request.get_response_sender()

    def send(self, response: GenerationResponse, final: bool) -> None:
        self._sender.send(_response(response.to_arrays(final)), flags=FINAL if final else 0)

    def send_error(self, message: str) -> None:
        self._sender.send(_error(message, pb_utils.TritonError.INTERNAL), flags=FINAL)

    def reject(self, message: str, code) -> None:
        self._sender.send(_error(message, code), flags=FINAL)

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()


def submit_all(requests: list, limits: EngineLimits, tokenizer: Tokenizer | None, submit) -> None:
    """Validate and enqueue each request of a decoupled `execute`; bad ones get their error now."""
    for request in requests:
        sender = ResponseSender(request)
        try:
            submit(parse_request(read_inputs(request), limits, tokenizer), sender)
        except RequestError as exc:
            sender.reject(str(exc), pb_utils.TritonError.INVALID_ARG)
        except QueueFull as exc:
            sender.reject(str(exc), pb_utils.TritonError.UNAVAILABLE)
        except Exception as exc:  # noqa: BLE001 - reported to this request only
            sender.reject(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)


def _exec(model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    inputs = [pb_utils.Tensor(name, np.ascontiguousarray(a)) for name, a in arrays.items()]
    response = pb_utils.InferenceRequest(model_name=model, requested_output_names=outputs, inputs=inputs).exec()
    if response.has_error():
        raise RuntimeError(f"{model}: {response.error().message()}")
    return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}


class BlsHops:
    """The scheduler's two hops as BLS calls into the `target` and `mtp` models."""

    overlaps = False  # a call returns with the `target` model's response
    decode_steps = 1

    def launch_target(self, batch: TargetBatch, hidden: bool = True, steps: int = 1) -> PendingTarget:
        if steps != 1:
            raise ValueError(f"decode_steps: the target model runs 1 step a call, got {steps}")
        outputs = ["output_ids", "num_accepted", "logprobs"] + (["hidden"] if hidden else [])
        return PendingTarget(TargetResult.from_arrays(_exec("target", batch.to_arrays(), outputs)), hidden)

    def mtp(self, batch: DraftBatch) -> DraftResult:
        arrays = _exec("mtp", batch.to_arrays(), ["draft_ids", "draft_top_ids", "draft_top_probs"])
        if arrays["draft_top_ids"].size == 0:  # argmax drafts carry no q
            del arrays["draft_top_ids"], arrays["draft_top_probs"]
        return DraftResult.from_arrays(arrays)


class TritonMetricSink:
    """EngineMetrics mirrored to Triton's metrics endpoint with `pb_utils.MetricFamily`."""

    def __init__(self) -> None:
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
            for name, text in COUNTERS.items()
        }
        self._families.update({
            name: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
            for name, text in GAUGES.items()
        })
        self._metrics: dict[tuple, object] = {}

    def _metric(self, name: str, labels: dict[str, str]):
        key = (name, tuple(sorted(labels.items())))
        if key not in self._metrics:
            self._metrics[key] = self._families[name].Metric(labels=labels)
        return self._metrics[key]

    def increment(self, name: str, value: float, labels: dict[str, str]) -> None:
        self._metric(name, labels).increment(value)

    def set(self, name: str, value: int, labels: dict[str, str]) -> None:
        self._metric(name, labels).set(value)


def step_model_settings(args: dict) -> tuple[dict[str, str], torch.device, torch.dtype, int]:
    """(parameters, device, dtype, max_slots) of a `target` / `mtp` model, checked at load time."""
    params = model_parameters(args)
    for key in ("format", "device", "dtype"):
        if key not in params:
            raise ValueError(f"config.pbtxt: parameter {key!r} is missing")
    if params["format"] not in FORMATS:
        raise ValueError(
            f"config.pbtxt: parameter 'format' must be one of {', '.join(FORMATS)}, got {params['format']!r}"
        )
    if params["dtype"] not in DTYPES:
        raise ValueError(f"config.pbtxt: parameter 'dtype' must be one of {', '.join(DTYPES)}, got {params['dtype']!r}")
    device = params["device"]
    if device not in ("cpu", "cuda"):
        raise ValueError(f"config.pbtxt: parameter 'device' must be cpu or cuda, got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("config.pbtxt: parameter 'device' is cuda but this host has no CUDA device")
        device = f"cuda:{args.get('model_instance_device_id', 0)}"
    int_parameter(params, "max_seq_len", 2)
    return params, torch.device(device), DTYPES[params["dtype"]], int_parameter(params, "max_slots", 1)


def artifact_dir(args: dict) -> Path:
    return Path(args["model_repository"]) / str(args["model_version"])


def log(message: str) -> None:
    """A line in tritonserver's log."""
    pb_utils.Logger.log_info(message)


def utf8_files() -> None:
    """Make open() read UTF-8. The Python backend's stub embeds the interpreter without setting its
    locale (nor UTF-8 mode, whatever PYTHONUTF8 says), so files open as ASCII, and torch.compile's
    inductor fails on import reading its UTF-8 templates."""
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


def load_model_step(directory: Path, params: dict[str, str], device: torch.device,
                    graphed: Callable[[Callable], graphs.Step],
                    eager: Callable[[Callable], graphs.Step] = lambda runner: runner) -> tuple[Callable, Callable]:
    """(runner, step) of a `target` / `mtp` model: the exported graphs in `directory`, sharded over
    `tensor_parallel_size` ranks, and the step the worker calls: `graphed(runner)` when the model
    captures decode graphs, else (or if that fails, with a log line) `eager(runner)`."""
    world_size = parallel.tensor_parallel_size(params, device)
    wanted = graphs.graphs_wanted(params, device, world_size)
    utf8_files()
    if compile_cache.merge_into_process_cache(directory):
        log(f"{directory}: merged the export's torch.compile cache into this process's")
    runner = parallel.load_parallel_step(directory, params["format"], device, world_size,
                                         compile=graphs.compile_at_load(params, device, world_size))
    if not wanted:
        return runner, eager(runner)
    return runner, graphs.with_decode_graphs(lambda: graphed(runner), eager(runner), log)


def target_worker(directory: Path, params: dict[str, str], device: torch.device,
                  max_slots: int) -> tuple[Callable, TargetWorker]:
    """(runner, worker) of the target artifacts in `directory`, as the `target` model serves them."""

    def graphed(runner):
        return graphs.target_graphs(runner, max_slots, int_parameter(params, "max_draft_tokens", 1), device,
                                    prefill_tokens=int_parameter(params, "prefill_graph_tokens", 0, default=0))

    runner, window = load_model_step(directory, params, device, graphed, verify_window)
    decode_steps = int_parameter(params, "decode_steps", 1, default=1)
    steps = None  # eager: `multi_step` over the window
    if decode_steps > 1:
        log(f"target: {decode_steps} steps a call over greedy rows without drafts (decode_steps)")
        if isinstance(window, graphs.GraphedTarget):
            steps = graphs.with_decode_graphs(lambda: graphs.steps_graphs(window, runner, decode_steps),
                                              multi_step(window, decode_steps), log)
    return runner, TargetWorker(window, max_slots, device, decode_steps, steps)


def draft_worker(directory: Path, params: dict[str, str], device: torch.device, dtype: torch.dtype,
                 max_slots: int) -> tuple[Callable, DraftWorker]:
    """(runner, worker) of the MTP artifacts in `directory`, as the `mtp` model serves them: per-layer
    graphs for sampled drafting and prompt absorption, and argmax drafting graphed whole."""
    num_layers = int_parameter(params, "num_mtp_layers", 1)
    max_draft = int_parameter(params, "max_draft_tokens", 1)
    hidden_size = int_parameter(params, "hidden_size", 1)

    def graphed(runner):
        return graphs.mtp_graphs(runner, num_layers, max_slots, max_draft, hidden_size, dtype, device)

    runner, step = load_model_step(directory, params, device, graphed)
    greedy = None
    if isinstance(step, graphs.GraphedMTP):  # graphed: the whole argmax chain too
        greedy = graphs.with_decode_graphs(lambda: graphs.draft_chain_graphs(runner, step, max_draft),
                                           functools.partial(draft_chain, step, num_layers), log)
    return runner, DraftWorker(step, num_layers, max_slots, device, dtype, greedy)


def engine_hops(args: dict) -> BlsHops | InProcessHops:
    """`spec_decode`'s hops: BLS calls into the `target` and `mtp` models, or, with parameter `hops`
    local, the workers themselves in this process over the artifacts in `1/target` and `1/mtp` (no
    process hop, no tensors through shared memory; one rank, so there are no rank processes to stop)."""
    mode = model_parameters(args).get("hops", "bls")
    if mode not in HOPS:
        raise ValueError(f"config.pbtxt: parameter 'hops' must be one of {', '.join(HOPS)}, got {mode!r}")
    if mode == "bls":
        return BlsHops()
    params, device, dtype, max_slots = step_model_settings(args)
    if parallel.tensor_parallel_size(params, device) > 1:
        raise ValueError("config.pbtxt: parameter 'tensor_parallel_size' must be 1 with hops local")
    _, target = target_worker(artifact_dir(args) / "target", params, device, max_slots)
    if not int_parameter(params, "num_mtp_layers", 0):
        return InProcessHops(target, None)
    mtp_runner, draft = draft_worker(artifact_dir(args) / "mtp", params, device, dtype, max_slots)
    chained = None
    if isinstance(target.window, graphs.GraphedTarget) and isinstance(draft.mtp, graphs.GraphedMTP):
        chained = graphs.with_decode_graphs(lambda: graphs.chain_graphs(target.window, mtp_runner, draft.mtp),
                                            None, log)  # None: chained steps draft through the chain's graphs
    return InProcessHops(target, draft, chained)


def close_model_step(runner: Callable) -> None:
    """Stop a tensor-parallel runner's ranks; a single-process runner holds nothing to stop."""
    if isinstance(runner, parallel.TensorParallelStep):
        runner.close()
