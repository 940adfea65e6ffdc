"""Triton adapter of `spec_decode` (decoupled): `execute` validates and enqueues; the scheduler thread
steps all live sequences with one `mtp` and one `target` hop per step, as BLS calls or (parameter
`hops` local) with the workers in this process."""
import sys

from triton_mtp.serving import triton_io
from triton_mtp.serving.metrics import EngineMetrics
from triton_mtp.serving.requests import (
    TokenizerFile, engine_limits, flag_parameter, int_parameter, switch_interval_s,
)
from triton_mtp.serving.responses import ResponseThreads
from triton_mtp.serving.scheduler import Scheduler


class TritonPythonModel:
    def initialize(self, args):
        params = triton_io.model_parameters(args)
        if (interval := switch_interval_s(params)) is not None:  # the engine's thread, the response threads and
            sys.setswitchinterval(interval)  # `execute` share one GIL: a short interval bounds the engine's waits
            triton_io.log(f"spec_decode: thread switch interval {sys.getswitchinterval() * 1e6:.0f} us")
        self.limits = engine_limits(params)
        tokenizer_path = triton_io.artifact_dir(args) / "tokenizer.json"
        self.tokenizer = TokenizerFile(tokenizer_path) if tokenizer_path.exists() else None
        hops = triton_io.engine_hops(args)
        metrics = EngineMetrics(self.limits.max_draft_tokens, triton_io.TritonMetricSink())
        threads = int_parameter(params, "response_threads", 0, default=0)
        # Response threads send streamed responses and ask whether requests were cancelled; the engine then reads
        # their answers every step. Without them the engine's step does both, asking at most every interval.
        lag_steps = int_parameter(params, "response_lag_steps", 0, default=0)
        self.responses = ResponseThreads(threads, triton_io.CANCEL_CHECK_INTERVAL_S, lag_steps) if threads else None
        cancel_check_interval_s = 0.0 if self.responses else triton_io.CANCEL_CHECK_INTERVAL_S
        self.scheduler = Scheduler(hops, self.limits, metrics, self.tokenizer,
                                   cancel_check_interval_s=cancel_check_interval_s,
                                   drain_responses=self.responses.drain if self.responses else None,
                                   stream_interval=int_parameter(params, "stream_interval", 1, default=1),
                                   spec_disable_rows=int_parameter(params, "spec_disable_rows", 0, default=0),
                                   overlap=flag_parameter(params, "overlap", default=True),
                                   separate_prefill=flag_parameter(params, "separate_prefill", default=True))
        self.scheduler.start()

    def execute(self, requests):
        triton_io.submit_all(requests, self.limits, self.tokenizer, self.submit)
        return None

    def submit(self, request, sender):
        if self.responses is None:
            self.scheduler.submit(request, sender)
        else:
            self.responses.submit(self.scheduler.submit, request, sender)

    def finalize(self):
        self.scheduler.stop()
        if self.responses is not None:
            self.responses.close()
