"""Triton adapter of the `mtp` model: absorb accepted tokens and draft for all live sequences per request."""
import numpy as np

from triton_mtp.serving import graphs, parallel, triton_io
from triton_mtp.serving.requests import int_parameter
from triton_mtp.serving.workers import DraftBatch, DraftWorker


class TritonPythonModel:
    def initialize(self, args):
        params, device, dtype, max_slots = triton_io.step_model_settings(args)
        num_layers = int_parameter(params, "num_mtp_layers", 1)
        world_size = parallel.tensor_parallel_size(params, device)
        self.runner = parallel.load_parallel_step(triton_io.artifact_dir(args), params["format"], device, world_size)
        step = self.runner
        if graphs.graphs_wanted(params, device, world_size):
            # the widest decode call: k + 1 absorbed pairs, then up to num_layers - 1 chained drafts
            width = int_parameter(params, "max_draft_tokens", 1) + num_layers
            hidden_size = int_parameter(params, "hidden_size", 1)
            step = graphs.with_decode_graphs(
                lambda: graphs.GraphedMTP(self.runner, num_layers, max_slots, width, hidden_size, dtype, device),
                self.runner, triton_io.log,
            )
        self.worker = DraftWorker(step, num_layers, max_slots, device, dtype)

    def execute(self, requests):
        return [triton_io.serve(request, self._propose) for request in requests]

    def finalize(self):
        if isinstance(self.runner, parallel.TensorParallelStep):
            self.runner.close()

    def _propose(self, arrays):
        result = self.worker.propose(DraftBatch.from_arrays(arrays)).to_arrays()
        result.setdefault("draft_top_ids", np.zeros((0, 0, 0), dtype=np.int64))  # argmax drafts carry no q
        result.setdefault("draft_top_probs", np.zeros((0, 0, 0), dtype=np.float32))
        return result
