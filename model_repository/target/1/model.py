"""Triton adapter of the `target` model: one verify (or prefill) call for all live sequences per request."""
from triton_mtp.export.graphs import load_step
from triton_mtp.serving import triton_io
from triton_mtp.serving.workers import TargetBatch, TargetWorker


class TritonPythonModel:
    def initialize(self, args):
        params, device, _, max_slots = triton_io.step_model_settings(args)
        runner = load_step(triton_io.artifact_dir(args), params["format"], device)
        self.worker = TargetWorker(runner, max_slots, device)

    def execute(self, requests):
        return [triton_io.serve(request, self._verify) for request in requests]

    def _verify(self, arrays):
        return self.worker.verify(TargetBatch.from_arrays(arrays)).to_arrays()
