"""Torch calls per engine step that enter the dispatcher (each lets go of the GIL and takes it back; on a GPU the
device ones also launch a kernel or a copy), counted with sys.setprofile for steps after the 20th of
`python -m triton_mtp.bench.engine_overhead <arguments>`, from whichever tree PYTHONPATH puts first. The
tensor <-> numpy conversions and metadata reads (numpy, from_numpy, tolist, numel, ...) hold the GIL and are
not counted.

    python count_ops.py <engine_overhead arguments>
"""
import collections
import sys

from triton_mtp.bench import engine_overhead
from triton_mtp.serving.scheduler import Scheduler

HOLDS_GIL = {"numpy", "from_numpy", "tolist", "numel", "element_size", "dim", "size", "is_contiguous", "item",
             "data_ptr", "__len__", "is_floating_point", "stride", "get_device"}
counted = {"steps": 0, "calls": collections.Counter()}
step = Scheduler.step


def profile(frame, event, arg) -> None:
    if event != "c_call":
        return
    kind = getattr(arg, "__qualname__", "").split(".")[0]  # torch.cat: _VariableFunctionsClass.cat
    if arg.__name__ in HOLDS_GIL or kind not in ("_VariableFunctionsClass", "Tensor", "TensorBase"):
        return
    counted["calls"][f"{kind}.{arg.__name__} <- {frame.f_code.co_qualname}"] += 1


def profiled_step(self):
    counted["steps"] += 1
    if counted["steps"] > 20:
        sys.setprofile(profile)
    try:
        return step(self)
    finally:
        sys.setprofile(None)


Scheduler.step = profiled_step
engine_overhead.main(sys.argv[1:])
steps = counted["steps"] - 20
print(f"dispatched torch calls per step: {sum(counted['calls'].values()) / steps:.1f} over {steps} steps")
for name, n in counted["calls"].most_common(30):
    print(f"{n / steps:7.2f}  {name}")
