"""perf_analyzer sweep of `spec_decode` over draft lengths and concurrencies, gRPC streaming.

    python3 bench/perf_analyzer/sweep.py --url localhost:8001 --draft-tokens 0,1,2,4 --concurrency 1,2,4,8 \
        --out runs/loadtest [-- extra perf_analyzer arguments]

For each draft length k the input data (`--input-data`, perf_analyzer's JSON format with `text_input`,
`max_tokens`, `num_draft_tokens`) is rewritten with `num_draft_tokens = k` (and `--max-tokens`) into `OUT/inputs_k{k}.json`;
for each concurrency c one perf_analyzer run writes `OUT/k{k}_c{c}.csv`. `OUT/summary.csv` joins
their rows with `num_draft_tokens` in front. k = 0 is plain decoding through the same model.
Standard library only: it runs in the tritonserver SDK image as well as next to an embedded server.
Exits non-zero when any run fails (perf_analyzer fails on any request error).
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path


def int_list(text: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]`; argparse reports the bad value."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def sweep_inputs(template: dict, num_draft_tokens: int, max_tokens: int | None, source: Path) -> dict:
    """The input data with every entry's `num_draft_tokens` (and `max_tokens` unless None) replaced."""
    entries = template.get("data")
    if not isinstance(entries, list) or not entries:
        raise SystemExit(f"sweep: {source}: 'data' must be a non-empty list of requests")
    rewritten = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or "max_tokens" not in entry:
            raise SystemExit(f"sweep: {source}: data[{index}] has no 'max_tokens'")
        rewritten.append({**entry, "num_draft_tokens": [num_draft_tokens]})
        if max_tokens is not None:
            rewritten[-1]["max_tokens"] = [max_tokens]
    return {**template, "data": rewritten}


def perf_analyzer_command(args: argparse.Namespace, inputs: Path, concurrency: int, report: Path) -> list[str]:
    return [
        args.perf_analyzer,
        "-m", args.model,
        "-i", "grpc",
        "--streaming",
        "-u", args.url,
        "--input-data", str(inputs),
        "--concurrency-range", f"{concurrency}:{concurrency}",
        "--measurement-mode", "count_windows",
        "--measurement-request-count", str(args.request_count),
        "-f", str(report),
        *args.extra,
    ]


def read_rows(report: Path, num_draft_tokens: int) -> list[dict[str, str]]:
    with open(report, newline="") as handle:
        return [{"num_draft_tokens": str(num_draft_tokens), **row} for row in csv.DictReader(handle)]


def write_summary(rows: list[dict[str, str]], path: Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint host:port")
    parser.add_argument("--model", default="spec_decode")
    parser.add_argument("--input-data", type=Path, default=here / "spec_decode_inputs.json")
    parser.add_argument("--draft-tokens", type=int_list, default=[0, 1, 2, 4], help="e.g. 0,1,2,4")
    parser.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    parser.add_argument("--max-tokens", type=int, help="replace every request's max_tokens")
    parser.add_argument("--request-count", type=int, default=64, help="requests per measurement window")
    parser.add_argument("--perf-analyzer", default="perf_analyzer", help="perf_analyzer executable")
    parser.add_argument("--out", type=Path, required=True, help="directory for inputs, reports and summary.csv")
    args = parser.parse_args(argv)
    args.extra = extra
    if shutil.which(args.perf_analyzer) is None:
        parser.error(f"--perf-analyzer: {args.perf_analyzer} not found (bench/perf_analyzer/install.sh installs it)")
    if not args.input_data.is_file():
        parser.error(f"--input-data: {args.input_data} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        template = json.loads(args.input_data.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"sweep: {args.input_data}: not valid JSON ({exc})") from None
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, str]] = []
    for k in args.draft_tokens:
        inputs = args.out / f"inputs_k{k}.json"
        inputs.write_text(json.dumps(sweep_inputs(template, k, args.max_tokens, args.input_data), indent=1))
        for concurrency in args.concurrency:
            report = args.out / f"k{k}_c{concurrency}.csv"
            print(f"== num_draft_tokens={k} concurrency={concurrency}", flush=True)
            done = subprocess.run(perf_analyzer_command(args, inputs, concurrency, report))
            if done.returncode != 0:
                print(f"sweep: perf_analyzer failed (exit {done.returncode}) at k={k} c={concurrency}", file=sys.stderr)
                return 1
            rows.extend(read_rows(report, k))
    write_summary(rows, args.out / "summary.csv")
    print(f"summary: {args.out / 'summary.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
