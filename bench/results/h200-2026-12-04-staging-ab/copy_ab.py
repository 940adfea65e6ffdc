"""A/B of the hop copies: pinned non-blocking (new) against pageable synchronous (old), in process."""
import argparse, json, sys, time
import torch
from triton_mtp.serving import workers, scheduler
import bench.engine_overhead as eo

new_copy = workers.packed_copy

def make(h2d_pinned, d2h_async):
    def copy(tensors, device, non_blocking=False):
        source = tensors[0].device
        to_device = h2d_pinned and source.type == "cpu" and device.type == "cuda"
        to_host = d2h_async and non_blocking and source.type == "cuda" and device.type == "cpu"
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // 8) * 8)
        buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=source, pin_memory=to_device)
        for t, offset, size in zip(tensors, offsets, sizes):
            buffer[offset: offset + size].view(t.dtype).view(t.shape).copy_(t)
        if to_host:
            moved = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True).copy_(buffer, non_blocking=True)
        else:
            moved = buffer.to(device, non_blocking=to_device)
        return [moved[o: o + s].view(t.dtype).view(t.shape) for t, o, s in zip(tensors, offsets, sizes)]
    return copy

modes = {"ring": new_copy, "old": make(False, False), "alloc": make(True, True)}
out = {}
# microbench: pinned alloc, and a payload copy each way
x = torch.zeros(4096, dtype=torch.uint8)
t = time.perf_counter()
for _ in range(2000):
    torch.empty(4096, dtype=torch.uint8, pin_memory=True)
out["pinned_alloc_us"] = (time.perf_counter() - t) / 2000 * 1e6
payload = [torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
           torch.zeros(1, dtype=torch.long), torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(1)]
for name, copy in modes.items():
    for _ in range(50):
        copy(payload, torch.device("cuda"))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        copy(payload, torch.device("cuda"))
    torch.cuda.synchronize()
    out[f"h2d_{name}_us"] = (time.perf_counter() - t) / 2000 * 1e6
print(json.dumps(out), flush=True)

ck = sys.argv[1]
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    for name, copy in modes.items():
        workers.packed_copy = scheduler.packed_copy = copy
        for b, ks, overlap in ((1, "0,3", False), (1, "0", True), (32, "0,3", False), (32, "0", True)):
            if rep and b == 32:
                continue
            args = argparse.Namespace(checkpoint=ck, device="cuda", dtype="bf16", prompts=b, prompt_tokens=128,
                                      max_tokens=128, draft_tokens=ks, graphs=True, moe=None, compile=False,
                                      spec_disable_rows=0, profile=None, out=None, overlap=overlap)
            r = eo.run(args)
            out[f"{name}_b{b}_{'overlap' if overlap else 'sync'}_rep{rep}"] = r["runs"]
            print(name, b, overlap, json.dumps(r["runs"]), flush=True)
workers.packed_copy = scheduler.packed_copy = new_copy
json.dump(out, open(sys.argv[2], "w"), indent=1)
