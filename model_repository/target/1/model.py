"""Triton adapter of the `target` model: one verify (or prefill) call for all live sequences per request."""
from triton_mtp.serving import graphs, triton_io
from triton_mtp.serving.requests import int_parameter
from triton_mtp.serving.workers import TargetBatch, TargetWorker


class TritonPythonModel:
    def initialize(self, args):
        params, device, _, max_slots = triton_io.step_model_settings(args)

        def graphed(runner):
            width = int_parameter(params, "max_draft_tokens", 1) + 1  # the verify window
            return graphs.GraphedTarget(runner, max_slots, width, device)

        self.runner, step = triton_io.load_model_step(args, params, device, graphed)
        self.worker = TargetWorker(step, max_slots, device)

    def execute(self, requests):
        return [triton_io.serve(request, self._verify) for request in requests]

    def finalize(self):
        triton_io.close_model_step(self.runner)

    def _verify(self, arrays):
        return self.worker.verify(TargetBatch.from_arrays(arrays)).to_arrays()
