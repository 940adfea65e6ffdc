"""Triton adapter of the `mtp` model: absorb accepted tokens and draft for all live sequences per request."""
import numpy as np

from triton_mtp.serving import graphs, triton_io
from triton_mtp.serving.requests import int_parameter
from triton_mtp.serving.workers import DraftBatch, DraftWorker


class TritonPythonModel:
    def initialize(self, args):
        params, device, dtype, max_slots = triton_io.step_model_settings(args)
        num_layers = int_parameter(params, "num_mtp_layers", 1)

        def graphed(runner):
            # the widest decode call: k + 1 absorbed pairs, then up to num_layers - 1 chained drafts
            width = int_parameter(params, "max_draft_tokens", 1) + num_layers
            hidden_size = int_parameter(params, "hidden_size", 1)
            return graphs.GraphedMTP(runner, num_layers, max_slots, width, hidden_size, dtype, device)

        self.runner, step = triton_io.load_model_step(args, params, device, graphed)
        self.worker = DraftWorker(step, num_layers, max_slots, device, dtype)

    def execute(self, requests):
        return [triton_io.serve(request, self._propose) for request in requests]

    def finalize(self):
        triton_io.close_model_step(self.runner)

    def _propose(self, arrays):
        result = self.worker.propose(DraftBatch.from_arrays(arrays)).to_arrays()
        result.setdefault("draft_top_ids", np.zeros((0, 0, 0), dtype=np.int64))  # argmax drafts carry no q
        result.setdefault("draft_top_probs", np.zeros((0, 0, 0), dtype=np.float32))
        return result
