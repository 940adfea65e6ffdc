"""Decoupled test model: for COUNT = n, streams n responses INDEX = 0..n-1, then the final flag."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            for index in range(count):
                output = pb_utils.Tensor("INDEX", np.array([index], dtype=np.int32))  # [1]
                sender.send(pb_utils.InferenceResponse(output_tensors=[output]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
