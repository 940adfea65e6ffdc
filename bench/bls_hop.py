"""Cost of one BLS hop (Python model -> Python model through the server) on this host.

Serves a caller/callee pair of KIND_CPU Python models: `hop_caller` runs `hops` back-to-back
`pb_utils.InferenceRequest(...).exec()` calls to `hop_callee` (identity) with a float32 payload and
reports the mean time per hop measured inside the server. A direct client -> `hop_callee` round trip
over gRPC is printed next to it for scale. Prints, asserts nothing.

    python bench/bls_hop.py [--hops 300] [--payload-bytes 8192] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from triton_mtp.serving.server import TritonServer, free_ports

CALLEE_CONFIG = """name: "hop_callee"
backend: "python"
max_batch_size: 0
input [ { name: "PAYLOAD", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "PAYLOAD_OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

CALLEE_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            payload = pb_utils.get_input_tensor_by_name(request, "PAYLOAD").as_numpy()  # [N]
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PAYLOAD_OUT", payload)]))
        return responses
'''

CALLER_CONFIG = """name: "hop_caller"
backend: "python"
max_batch_size: 0
input [
  { name: "PAYLOAD", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "HOPS", data_type: TYPE_INT32, dims: [ 1 ] }
]
output [ { name: "MS_PER_HOP", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

CALLER_MODEL = '''import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            payload = pb_utils.get_input_tensor_by_name(request, "PAYLOAD").as_numpy()  # [N]
            hops = int(pb_utils.get_input_tensor_by_name(request, "HOPS").as_numpy()[0])
            tensor = pb_utils.Tensor("PAYLOAD", payload)
            start = time.perf_counter()
            for _ in range(hops):
                hop = pb_utils.InferenceRequest(
                    model_name="hop_callee", requested_output_names=["PAYLOAD_OUT"], inputs=[tensor]
                ).exec()
                if hop.has_error():
                    raise pb_utils.TritonModelException(hop.error().message())
            ms = (time.perf_counter() - start) * 1000 / hops
            out = pb_utils.Tensor("MS_PER_HOP", np.array([ms], dtype=np.float32))  # [1]
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
'''


def write_repository(root: Path) -> None:
    models = (("hop_callee", CALLEE_CONFIG, CALLEE_MODEL), ("hop_caller", CALLER_CONFIG, CALLER_MODEL))
    for name, config, model in models:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(model)


def tensor(name: str, values: np.ndarray, dtype: str) -> grpcclient.InferInput:
    value = grpcclient.InferInput(name, list(values.shape), dtype)
    value.set_data_from_numpy(values)
    return value


def measure(server: TritonServer, hops: int, payload_bytes: int, repeats: int) -> tuple[list[float], list[float]]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    payload = np.random.default_rng(0).random(payload_bytes // 4, dtype=np.float32)  # [N]
    inputs = [tensor("PAYLOAD", payload, "FP32"), tensor("HOPS", np.array([hops], dtype=np.int32), "INT32")]
    client.infer("hop_caller", inputs)  # warm-up
    bls_ms = [float(client.infer("hop_caller", inputs).as_numpy("MS_PER_HOP")[0]) for _ in range(repeats)]

    direct = [tensor("PAYLOAD", payload, "FP32")]
    client.infer("hop_callee", direct)  # warm-up
    direct_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(hops):
            client.infer("hop_callee", direct)
        direct_ms.append((time.perf_counter() - start) * 1000 / hops)
    return bls_ms, direct_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hops", type=int, default=300, help="BLS calls per measurement")
    parser.add_argument("--payload-bytes", type=int, default=8192, help="size of the float32 tensor sent each hop")
    parser.add_argument("--repeats", type=int, default=3, help="measurements; the median is reported")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bls-hop-") as root:
        write_repository(Path(root))
        with TritonServer(root, *free_ports(3)) as server:
            bls_ms, direct_ms = measure(server, args.hops, args.payload_bytes, args.repeats)
    print(f"payload {args.payload_bytes} B float32, {args.hops} calls x {args.repeats} repeats (median, ms per call)")
    print(f"  BLS hop KIND_CPU -> KIND_CPU (in server)   {statistics.median(bls_ms):.3f}")
    print(f"  client -> model over gRPC (round trip)     {statistics.median(direct_ms):.3f}")


if __name__ == "__main__":
    main()
