"""Triton adapter of `spec_decode` (decoupled): `execute` validates and enqueues; the scheduler thread
steps all live sequences with one `mtp` and one `target` hop per step, as BLS calls or (parameter
`hops` local) with the workers in this process."""
from triton_mtp.serving import triton_io
from triton_mtp.serving.metrics import EngineMetrics
from triton_mtp.serving.requests import TokenizerFile, engine_limits
from triton_mtp.serving.scheduler import Scheduler


class TritonPythonModel:
    def initialize(self, args):
        self.limits = engine_limits(triton_io.model_parameters(args))
        tokenizer_path = triton_io.artifact_dir(args) / "tokenizer.json"
        self.tokenizer = TokenizerFile(tokenizer_path) if tokenizer_path.exists() else None
        hops = triton_io.engine_hops(args)
        metrics = EngineMetrics(self.limits.max_draft_tokens, triton_io.TritonMetricSink())
        self.scheduler = Scheduler(hops, self.limits, metrics, self.tokenizer,
                                   cancel_check_interval_s=triton_io.CANCEL_CHECK_INTERVAL_S)
        self.scheduler.start()

    def execute(self, requests):
        triton_io.submit_all(requests, self.limits, self.tokenizer, self.scheduler.submit)
        return None

    def finalize(self):
        self.scheduler.stop()
