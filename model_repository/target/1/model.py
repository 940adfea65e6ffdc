"""Triton adapter of the `target` model: one verify (or prefill) call for all live sequences per request."""
from triton_mtp.serving import graphs, parallel, triton_io
from triton_mtp.serving.requests import int_parameter
from triton_mtp.serving.workers import TargetBatch, TargetWorker


class TritonPythonModel:
    def initialize(self, args):
        params, device, _, max_slots = triton_io.step_model_settings(args)
        world_size = parallel.tensor_parallel_size(params, device)
        self.runner = parallel.load_parallel_step(triton_io.artifact_dir(args), params["format"], device, world_size)
        step = self.runner
        if graphs.graphs_wanted(params, device, world_size):
            width = int_parameter(params, "max_draft_tokens", 1) + 1  # the verify window
            step = graphs.with_decode_graphs(
                lambda: graphs.GraphedTarget(self.runner, max_slots, width, device), self.runner, triton_io.log
            )
        self.worker = TargetWorker(step, max_slots, device)

    def execute(self, requests):
        return [triton_io.serve(request, self._verify) for request in requests]

    def finalize(self):
        if isinstance(self.runner, parallel.TensorParallelStep):
            self.runner.close()

    def _verify(self, arrays):
        return self.worker.verify(TargetBatch.from_arrays(arrays)).to_arrays()
