"""Test model: returns the numpy version the Python backend stub imported."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        version = np.array([np.__version__.encode()], dtype=np.object_)  # [1] bytes
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("VERSION", version)]) for _ in requests]
