"""Triton adapter of the `mtp` model: absorb accepted tokens and draft for all live sequences per request."""
import numpy as np

from triton_mtp.serving import triton_io
from triton_mtp.serving.workers import DraftBatch


class TritonPythonModel:
    def initialize(self, args):
        params, device, dtype, max_slots = triton_io.step_model_settings(args)
        self.runner, self.worker = triton_io.draft_worker(triton_io.artifact_dir(args), params, device, dtype, max_slots)

    def execute(self, requests):
        return [triton_io.serve(request, self._propose) for request in requests]

    def finalize(self):
        triton_io.close_model_step(self.runner)

    def _propose(self, arrays):
        result = self.worker.propose(DraftBatch.from_arrays(arrays)).to_arrays()
        result.setdefault("draft_top_ids", np.zeros((0, 0, 0), dtype=np.int64))  # argmax drafts carry no q
        result.setdefault("draft_top_probs", np.zeros((0, 0, 0), dtype=np.float32))
        return result
