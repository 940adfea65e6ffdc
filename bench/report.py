"""Merge the benchmarks' result files into results.json + results.md (tables, targets P1-P5) and PNG plots.

Every ratio comes from the one run whose files are merged. A benchmark that did not produce its file
is listed as missing and the targets that need it read "n/a".

    python -m bench.report --stages WORK_DIR --out OUT_DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STAGES = ("capture", "triton", "triton_local", "standalone", "standalone_compiled", "hf_generate", "realistic")
TRITON = {"triton": "bls", "triton_local": "local"}  # stage: the `spec_decode` hops it served with
STANDALONE = ("standalone", "standalone_compiled")
TARGETS = {  # name: (description, comparison, threshold)
    "P1": ("best-k speculative / plain tokens/s through Triton, batch 1", ">=", 2.2),
    "P2": ("plain through Triton / the fastest standalone loop, batch 1", ">=", 0.85),
    "P3": ("plain aggregate tokens/s at 32 streams / 1 stream", ">=", 12.0),
    "P3-spec": ("speculative / plain aggregate tokens/s at 32 streams", ">=", 1.3),
    "P4": ("decode-step time / floor, realistic config, grouped (selected-experts) MoE as served", "<=", 1.3),
    "P5": ("plain through Triton / transformers generate, batch 1", ">=", 20.0),
}


def load_stages(directory: Path) -> dict[str, Any]:
    """{stage: result} for each `<stage>.json` present in `directory`."""
    results = {}
    for stage in STAGES:
        path = directory / f"{stage}.json"
        if path.is_file():
            results[stage] = json.loads(path.read_text())
    return results


def _get(results: dict[str, Any], *keys: str) -> float | None:
    value: Any = results
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) else None


def _first(values) -> float | None:
    return next((v for v in values if v is not None), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: dict[str, Any], stage: str = "triton") -> dict[str, float | None]:
    """The targets' ratios from one run's results, "through Triton" meaning `stage` (None where an input is missing)."""
    batch1 = results.get(stage, {}).get("batch1", {})
    spec = {k: r["tokens_per_s"] for k, r in batch1.items() if k != "0"}
    best = max(spec, key=spec.get) if spec else ""
    plain = _get(results, stage, "batch1", "0", "tokens_per_s")
    standalone = [_get(results, loop, "runs", "0", "tokens_per_s") for loop in STANDALONE]
    return {
        "P1": _ratio(_get(results, stage, "batch1", best, "tokens_per_s"), plain),
        "P2": _ratio(plain, max((v for v in standalone if v is not None), default=None)),
        "P3": _ratio(_get(results, stage, "sweep", "plain", "32", "tokens_per_s"),
                     _get(results, stage, "sweep", "plain", "1", "tokens_per_s")),
        "P3-spec": _ratio(_get(results, stage, "sweep", "spec", "32", "tokens_per_s"),
                          _get(results, stage, "sweep", "plain", "32", "tokens_per_s")),
        "P4": _first(_get(results, "realistic", "moe", name, "step_over_floor") for name in ("fused", "selected")),
        "P5": _ratio(plain, _get(results, "hf_generate", "tokens_per_s")),
    }


def all_ratios(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """{hops: the targets' ratios} for each Triton stage in the run."""
    return {hops: ratios(results, stage) for stage, hops in TRITON.items() if stage in results or stage == "triton"}


def same_outputs(results: dict[str, Any], stage: str = "triton") -> dict[str, tuple[int, int]]:
    """Per k run by both: requests whose greedy tokens through Triton (`stage`) equal the standalone loop's."""
    triton = results.get(stage, {}).get("batch1", {})
    standalone = results.get("standalone", {}).get("runs", {})
    matches = {}
    for k in triton.keys() & standalone.keys():
        a, b = triton[k].get("outputs", []), standalone[k].get("outputs", [])
        matches[k] = (sum(x == y for x, y in zip(a, b)), min(len(a), len(b)))
    return dict(sorted(matches.items()))


def agreement_with_plain(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per k > 0: how far greedy speculative outputs equal the same run's plain (k = 0) outputs.

    `requests`: the fraction of requests whose tokens are identical; `tokens`: the fraction of plain
    tokens reproduced before the first difference. Exact in fp32; in bf16 a batched verify window can
    flip a near-tie of the argmax, after which the two continuations differ.
    """
    plain = runs.get("0", {}).get("outputs")
    if not plain:
        return {}
    agreement = {}
    for k, run in runs.items():
        outputs = run.get("outputs")
        if k == "0" or not outputs:
            continue
        same = sum(a == b for a, b in zip(outputs, plain))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(outputs, plain))
        agreement[k] = {"requests": same / len(plain), "tokens": prefix / max(1, sum(len(b) for b in plain))}
    return agreement


def _met(value: float | None, comparison: str, threshold: float) -> str:
    if value is None:
        return "n/a"
    return "met" if (value >= threshold if comparison == ">=" else value <= threshold) else "missed"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " / ".join(f"{v:.{digits}f}" for v in value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(results: dict[str, Any], targets: dict[str, dict[str, float | None]]) -> str:
    lines = ["# triton-mtp benchmark results", ""]
    env = next((r["environment"] for r in results.values() if "environment" in r), {})
    lines.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    missing = [s for s in STAGES if s not in results]
    if missing:
        lines.append(f"Not in this run (skipped, failed or cut by the deadline; see bench.log): {', '.join(missing)}")
    modes = list(targets) or ["bls"]
    lines += ["", "## Targets", "", "Through Triton with `spec_decode`'s hops as BLS calls (bls) and with the workers in "
              "its own process (local, `export --hops local`).", "",
              "| target | what | " + " | ".join(f"{m} ratio | {m} result" for m in modes) + " | goal |",
              "|---|---|" + "---|---|" * len(modes) + "---|"]
    for name, (what, comparison, threshold) in TARGETS.items():
        cells = [f"{_fmt(v)} | {_met(v, comparison, threshold)}" for v in (targets.get(m, {}).get(name) for m in modes)]
        lines.append(f"| {name} | {what} | {' | '.join(cells)} | {comparison} {threshold} |")
    rows = []
    for stage, hops in TRITON.items():
        for k, r in results.get(stage, {}).get("batch1", {}).items():
            rows.append((f"Triton ({hops}) k={k}", r))
    for stage in STANDALONE:
        for k, r in results.get(stage, {}).get("runs", {}).items():
            rows.append((f"standalone ({results[stage]['graphs']}) k={k}", r))
    if rows:
        lines += ["", "## Batch 1", "", "| run | tokens/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | acceptance per position "
                  "| mean accepted length | hops/token |", "|---|---|---|---|---|---|---|---|"]
        for name, r in rows:
            lines.append(f"| {name} | {_fmt(r['tokens_per_s'], 1)} | {_fmt(r['ttft']['p50_ms'])} | {_fmt(r['itl']['p50_ms'])} "
                         f"| {_fmt(r['itl']['p99_ms'])} | {_fmt(r.get('acceptance_per_position'))} "
                         f"| {_fmt(r.get('mean_accepted_length'))} | {_fmt(r.get('hops_per_token'))} |")
    if "hf_generate" in results:
        lines.append(f"| transformers generate | {_fmt(results['hf_generate']['tokens_per_s'], 1)} | - | - | - | - | - | - |")
    calls = [(k, r["models"]) for k, r in results.get("triton", {}).get("batch1", {}).items()
             if r.get("models", {}).get("target", {}).get("calls")]
    if calls:
        lines += ["", "Server time per call of the hop models (Prometheus counters over the run; compute = the model's "
                  "execute, request = queue + compute):", "",
                  "| run | target calls | target compute ms | target request ms | mtp calls | mtp compute ms | mtp request ms |",
                  "|---|---|---|---|---|---|---|"]
        for k, m in calls:
            t, d = m["target"], m["mtp"]
            lines.append(f"| Triton (bls) k={k} | {t['calls']:.0f} | {_fmt(t['compute_ms'], 3)} | {_fmt(t['request_ms'], 3)} "
                         f"| {d['calls']:.0f} | {_fmt(d['compute_ms'], 3)} | {_fmt(d['request_ms'], 3)} |")
    phases = [(f"Triton ({hops}) k={k}", r) for stage, hops in TRITON.items()
              for k, r in results.get(stage, {}).get("batch1", {}).items() if r.get("step_ms")]
    if phases:
        lines += ["", "Engine step time inside the server by phase (spec_decode's counters over the run; mtp and "
                  "target are the two hops, respond the streamed responses, engine the rest):", "",
                  "| run | steps | step ms | mtp ms | target ms | respond ms | engine ms |", "|---|---|---|---|---|---|---|"]
        for name, r in phases:
            ms = r["step_ms"]
            lines.append(f"| {name} | {r['steps']:.0f} | {_fmt(sum(ms.values()), 3)} | "
                         + " | ".join(_fmt(ms.get(phase), 3) for phase in ("mtp", "target", "respond", "engine")) + " |")
    for stage, hops in TRITON.items():
        matches = same_outputs(results, stage)
        if matches:
            lines += ["", f"Greedy outputs through Triton ({hops}) equal the standalone loop's: "
                      + ", ".join(f"k={k} {same}/{total} requests" for k, (same, total) in matches.items()) + "."]
    agreements = {name: agreement_with_plain(runs) for name, runs in _runs_by_loop(results).items()}
    if any(agreements.values()):
        lines += ["", "Greedy speculative output against the same loop's plain output (requests identical; "
                  "plain tokens reproduced before the first difference): "
                  + "; ".join(f"{name} " + ", ".join(f"k={k} {a['requests']:.2f} / {a['tokens']:.3f}" for k, a in found.items())
                              for name, found in agreements.items() if found) + "."]
    sweeps = {hops: results[stage] for stage, hops in TRITON.items() if results.get(stage, {}).get("sweep")}
    if sweeps:
        lines += ["", "## Concurrency sweep (spec: the best k of batch 1)", "",
                  "| hops | run | streams | aggregate tokens/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | hops/token |",
                  "|---|---|---|---|---|---|---|---|"]
        for hops, found in sweeps.items():
            for name, levels in found["sweep"].items():
                label = f"{name} (k={found.get('best_k')})" if name == "spec" else name
                for streams, r in levels.items():
                    lines.append(f"| {hops} | {label} | {streams} | {_fmt(r['tokens_per_s'], 1)} | {_fmt(r['itl']['p50_ms'])} "
                                 f"| {_fmt(r['itl']['p99_ms'])} | {_fmt(r['ttft']['p50_ms'])} | {_fmt(r['hops_per_token'])} |")
    capture = results.get("capture", {}).get("repositories", {})
    if capture:
        lines += ["", "## Decode graphs over the exported artifacts, outside Triton (bench/capture_check.py)", "",
                  "| format | model | host sync in a call | captured | eager ms (batch 1) | graphed ms (batch 1) "
                  "| graphed ms, padded to the window | error |",
                  "|---|---|---|---|---|---|---|---|"]
        for found in capture.values():
            models = {m: found[m] for m in ("target", "mtp") if m in found} or {"-": {"error": found.get("stderr", "")[-200:]}}
            for model, r in models.items():
                lines.append(f"| {found['format']} | {model} | {r.get('host_sync') or 'none'} | {r.get('captured', False)} "
                             f"| {_fmt(r.get('eager_ms'), 3)} | {_fmt(r.get('graphed_ms'), 3)} "
                             f"| {_fmt(r.get('graphed_window_ms'), 3)} | {' '.join(r.get('error', '').split())[:200]} |")
    realistic = results.get("realistic")
    if realistic:
        lines += ["", f"## Realistic configuration ({realistic['layers']} layers, hidden {realistic['hidden_size']}, "
                  f"{realistic['routed_experts']} routed experts, context {realistic['context']}, {realistic['graphs']})", "",
                  f"Copy bandwidth {realistic['copy_bandwidth_GBps']:.1f} GB/s (read + write); KV bytes {realistic['kv_bytes']}; "
                  f"selected: {'the grouped MoE (grouped_mm)' if realistic['grouped_mm'] else 'not run (no native grouped_mm)'}; "
                  "fused: the grouped MoE with its decode kernels (export/fused_moe.py), as served.", "",
                  "| MoE | params touched per step | step ms | eager step ms | floor ms | step / floor |", "|---|---|---|---|---|---|"]
        for name, r in realistic["moe"].items():
            lines.append(f"| {name} | {r['params_touched'] / 1e9:.3f} B | {_fmt(r['step_ms'], 3)} | {_fmt(r['eager_step_ms'], 2)} "
                         f"| {_fmt(r['floor_ms'], 3)} | {_fmt(r['step_over_floor'])} |")
    return "\n".join(lines) + "\n"


def _runs_by_loop(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{loop name: {k: run}} for Triton's batch-1 runs and each standalone loop."""
    loops = {f"Triton ({hops})": results.get(stage, {}).get("batch1", {}) for stage, hops in TRITON.items()}
    loops.update({stage: results.get(stage, {}).get("runs", {}) for stage in STANDALONE})
    return loops


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """sweep.png (aggregate tokens/s vs streams) and acceptance.png (per position, batch 1); none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sweeps = {hops: results[stage]["sweep"] for stage, hops in TRITON.items() if results.get(stage, {}).get("sweep")}
    if sweeps:
        fig, ax = plt.subplots(figsize=(6, 4))
        for hops, sweep in sweeps.items():
            for name, levels in sweep.items():
                streams = [int(s) for s in levels]
                ax.plot(streams, [levels[str(s)]["tokens_per_s"] for s in streams], marker="o", label=f"{name} ({hops})")
        ax.set(xscale="log", xlabel="concurrent streams", ylabel="aggregate tokens/s", title="tokens/s vs concurrency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=120)
        plt.close(fig)
        written.append(out / "sweep.png")
    batch1 = {k: r for k, r in results.get("triton", {}).get("batch1", {}).items() if r.get("acceptance_per_position")}
    if batch1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for k, r in batch1.items():
            rates = r["acceptance_per_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"k={k}")
        ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="acceptance per position (batch 1)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=120)
        plt.close(fig)
        written.append(out / "acceptance.png")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stages", required=True, help="directory holding <stage>.json files")
    parser.add_argument("--out", required=True, help="directory for results.json, results.md and the plots")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = load_stages(Path(args.stages))
    targets = all_ratios(results)
    summary = {"targets": targets,
               "triton_equals_standalone": {hops: same_outputs(results, stage) for stage, hops in TRITON.items()},
               "agreement_with_plain": {name: agreement_with_plain(runs) for name, runs in _runs_by_loop(results).items()},
               **results}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results, targets))
    plots(results, out)
    for hops, found in targets.items():
        for name, value in found.items():
            what, comparison, threshold = TARGETS[name]
            print(f"{name} ({hops}): {_fmt(value)} ({comparison} {threshold}: {_met(value, comparison, threshold)}) {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
