"""Where a torch.compile'd target step departs from eager: per part, per call, per layer and per inductor setting.

Replays the export's parity calls (a prefill chunk with a padded row, a verify window, a one-token
step) through an eager target and a second copy of it with one piece compiled, and writes for each
experiment and call the relative errors of the logits, the hidden states and each layer's KV cache,
and whether the argmax tokens agree:

    python -m bench.compile_bisect --checkpoint models/tiny-dsv3-mtp --out compile_bisect.json

Experiments, in order, until `--time-limit` seconds have passed: eager against eager, the whole
step compiled as the eager format did before it emulated eager's rounding, each decoder layer alone,
the whole step with eager's rounding (`export.formats.eager.COMPILE_OPTIONS`, as served), static
shapes, the aot_eager backend (graph capture and functionalization without inductor), fp32, the
dense MoE, and each layer's attention and MLP alone.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from .common import environment, write_result
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.formats.eager import COMPILE_OPTIONS
from triton_mtp.export.graphs import _parity_calls, _relative_error

Make = Callable[[nn.Module], Callable]


def whole(**options) -> Make:
    return lambda model: torch.compile(model, **options)


def only(path: str, **options) -> Make:
    """Compile the submodule at `path` alone; the rest of the model stays eager."""
    def make(model: nn.Module) -> Callable:
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, torch.compile(getattr(owner, leaf), **options))
        return model
    return make


def experiments(num_layers: int) -> list[tuple[str, str, str, Make]]:
    """(name, dtype, moe, make) in the order they run; `_dynamic` is torch.compile(dynamic=True) as
    the eager format compiled before COMPILE_OPTIONS, `emulate_casts` with them (as it serves now)."""
    cases = [("eager_vs_eager", "bf16", "grouped", lambda model: model),
             ("whole_dynamic", "bf16", "grouped", whole(dynamic=True))]
    cases += [(f"layer{i}_dynamic", "bf16", "grouped", only(f"model.layers.{i}", dynamic=True)) for i in range(num_layers)]
    cases += [("whole_dynamic_emulate_casts", "bf16", "grouped", whole(dynamic=True, options=COMPILE_OPTIONS)),
              ("whole_static", "bf16", "grouped", whole(dynamic=False)),
              ("whole_aot_eager", "bf16", "grouped", whole(dynamic=True, backend="aot_eager")),
              ("fp32_dense_whole_dynamic", "fp32", "dense", whole(dynamic=True)),
              ("bf16_dense_whole_dynamic", "bf16", "dense", whole(dynamic=True))]
    for i in range(num_layers):
        cases += [(f"attn{i}_dynamic", "bf16", "grouped", only(f"model.layers.{i}.self_attn", dynamic=True)),
                  (f"mlp{i}_dynamic", "bf16", "grouped", only(f"model.layers.{i}.mlp", dynamic=True))]
    return cases


def replay(eager: nn.Module, other: nn.Module, call: Callable, verify_tokens: int) -> list[dict]:
    """Errors of `call` (over `other`'s pool) against `eager`, per parity call."""
    eager.reset_cache()
    other.reset_cache()
    rows = []
    with torch.no_grad():
        for inputs, valid in _parity_calls(eager, False, verify_tokens, 0):
            expected, got = eager(*inputs), call(*inputs)
            layers = range(eager.kv_cache.shape[0])
            rows.append({"logits": _relative_error(got[0][valid], expected[0][valid]),
                         "hidden": _relative_error(got[1][valid], expected[1][valid]),
                         "kv_cache": [_relative_error(other.kv_cache[i, :, :-1], eager.kv_cache[i, :, :-1])
                                      for i in layers],
                         "argmax_agrees": float((got[0].argmax(-1) == expected[0].argmax(-1))[valid].float().mean())})
    return rows


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    result = {"benchmark": "compile_bisect", "checkpoint": args.checkpoint, "device": args.device,
              "environment": environment(), "experiments": {}}

    def load(dtype: str, moe: str) -> nn.Module:
        _, target, _ = load_checkpoint(args.checkpoint, dtype, args.device, max_slots=4, max_seq_len=64,
                                       progress=False, moe=moe)
        return target

    eager: dict[tuple[str, str], nn.Module] = {}
    layers = load("fp32", "dense").config.num_hidden_layers
    for name, dtype, moe, make in experiments(layers):
        if time.perf_counter() - start > args.time_limit:
            result["experiments"][name] = "not run: time limit"
            continue
        if (dtype, moe) not in eager:
            eager[dtype, moe] = load(dtype, moe)
        torch._dynamo.reset()
        begun = time.perf_counter()
        other = load(dtype, moe)
        try:
            rows = replay(eager[dtype, moe], other, make(other), args.verify_tokens)
            result["experiments"][name] = {"calls": rows, "seconds": time.perf_counter() - begun}
        except Exception as exc:  # noqa: BLE001 - a failing experiment is a finding, the others still run
            result["experiments"][name] = {"error": repr(exc)[:2000], "seconds": time.perf_counter() - begun}
        worst = max((max(c["logits"], c["hidden"]) for c in result["experiments"][name].get("calls", [])), default=None)
        print(f"{name}: worst relative error {worst}", flush=True)
        write_result(args.out, result)  # what is done so far survives a time limit
    write_result(args.out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--verify-tokens", type=int, default=5, help="the verify window (max draft tokens + 1)")
    parser.add_argument("--time-limit", type=float, default=430.0, help="start no experiment after this many seconds")
    parser.add_argument("--out", required=True, help="result JSON file")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
