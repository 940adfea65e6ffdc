"""Test model: OUTPUT0 = INPUT0 + 1; counts requests in the custom metric `add_one_requests_total`."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(
            name="add_one_requests_total",
            description="requests served by add_one",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.requests = self.family.Metric(labels={"model": "add_one"})

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()  # [N] float32
            output = pb_utils.Tensor("OUTPUT0", (values + np.float32(1)).astype(np.float32))  # [N]
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
            self.requests.increment(1)
        return responses
