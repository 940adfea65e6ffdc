"""Triton adapter of the `target` model: one verify (or prefill) call for all live sequences per request."""
from triton_mtp.serving import triton_io
from triton_mtp.serving.workers import TargetBatch


class TritonPythonModel:
    def initialize(self, args):
        params, device, _, max_slots = triton_io.step_model_settings(args)
        self.runner, self.worker = triton_io.target_worker(triton_io.artifact_dir(args), params, device, max_slots)

    def execute(self, requests):
        return [triton_io.serve(request, self._verify) for request in requests]

    def finalize(self):
        triton_io.close_model_step(self.runner)

    def _verify(self, arrays):
        return self.worker.verify(TargetBatch.from_arrays(arrays)).to_arrays()
