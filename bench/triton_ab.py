"""An A/B of `spec_decode`'s config parameters in one server: the export as it is and each change served side by
side, measured in turns. A change `code=DIR` serves the model with the project's code from DIR, a tree of this
repository (`git archive <commit> | tar -x -C DIR`): an A/B of code versions on one machine (local hops: the
workers run in `spec_decode`'s process too).

Each change ("key=value[,key=value]") becomes a model of its own, `spec_decode_ab<i>`, whose config.pbtxt is the
export's with those parameters changed and whose version folder is a link to the export's (one copy of the
artifacts). Triton loads the models together, so an A/B costs one server start instead of one per change
(about 70 s each for compiled graphs on the GPU host). The models' engine counters share their series; a
level's deltas are its model's alone because only that model has requests meanwhile. Every round measures every
model at every concurrency level in turn, so drift on a noisy host spreads over all of them.

    python -m bench.triton_ab --checkpoint DIR --repository REPO --change response_lag_steps=1 --out ab.json
"""
from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from triton_mtp.export.cli import at_least

from .common import environment, held_out_prompts, write_result
from .triton_bench import MODEL, STOP_GRACE_S, run_level

_PARAMETER = r'(key: "{key}", value: {{ string_value: )"([^"]*)"'
CODE = "code"  # change key: serve the model with the project's code from another tree (an earlier commit's)


def parsed_change(change: str) -> dict[str, str]:
    """{key: value} of a change ("key=value[,key=value]")."""
    items = {}
    for item in change.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"change {change!r}: {item!r} is not key=value")
        items[key] = value
    return items


def changed_config(config: str, name: str, change: str) -> str:
    """`config` (a config.pbtxt) as model `name`, with the parameters in `change` ("key=value[,key=value]"; `code`
    is not a parameter: `code_version`)."""
    config, n = re.subn(rf'^name: "{MODEL}"', f'name: "{name}"', config, flags=re.MULTILINE)
    if n != 1:
        raise ValueError(f"config.pbtxt: no line 'name: \"{MODEL}\"'")
    for key, value in parsed_change(change).items():
        if key == CODE:
            continue
        config, n = re.subn(_PARAMETER.format(key=re.escape(key)), lambda m: f'{m[1]}"{value}"', config)
        if n != 1:
            raise ValueError(f"change {change!r}: no parameter {key!r} in config.pbtxt")
    return config


_CODE_MODEL = '''"""spec_decode served with the code of {tree} (bench/triton_ab.py, change `code`)."""
import importlib.util
import sys

sys.path.insert(0, {shim!r})
_spec = importlib.util.spec_from_file_location("spec_decode_code", {model!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
TritonPythonModel = _module.TritonPythonModel
'''


def code_version(tree: Path, version: Path, into: Path) -> None:
    """Version folder `into`: the export's `version` with its model.py replaced by one that serves `tree`'s code (a
    folder in this repository's layout, as `git archive <commit>` writes it), imported through a shim of links
    where pyproject.toml maps the packages."""
    if not (tree / "serving").is_dir():
        raise ValueError(f"change {CODE}={tree}: not a tree of this project (no serving/)")
    into.mkdir()
    for entry in version.iterdir():
        if entry.name != "model.py":
            (into / entry.name).symlink_to(entry.resolve())
    shim = into / "code" / "triton_mtp"  # in the version folder: a folder beside the models would be one to Triton
    shim.mkdir(parents=True)
    for path in (tree / "triton_mtp").glob("*.py"):
        (shim / path.name).symlink_to(path.resolve())
    for package in ("export", "serving", "client", "train", "model_repository", "bench"):
        (shim / package).symlink_to((tree / package).resolve(), target_is_directory=True)
    model = (tree / "model_repository" / MODEL / "1" / "model.py").resolve()
    (into / "model.py").write_text(_CODE_MODEL.format(tree=tree.resolve(), shim=str(shim.parent), model=str(model)))


def ab_repository(repository: Path, changes: list[str], directory: Path) -> dict[str, str]:
    """Write into `directory` the export's `spec_decode` and one model per change; returns {model: change}
    (the export itself under "")."""
    source = repository / MODEL
    (directory / MODEL).symlink_to(source.resolve(), target_is_directory=True)
    models = {MODEL: ""}
    config = (source / "config.pbtxt").read_text()
    for i, change in enumerate(changes):
        name = f"{MODEL}_ab{i}"
        code = parsed_change(change).get(CODE)
        hops = re.search(_PARAMETER.format(key="hops"), config)
        if code and (hops is None or hops[2] != "local"):
            raise ValueError(f"change {change!r}: {CODE} needs an export --hops local (with BLS hops the target and "
                             "mtp models would still run the export's code)")
        (directory / name).mkdir()
        (directory / name / "config.pbtxt").write_text(changed_config(config, name, change))
        for version in (p for p in source.iterdir() if p.is_dir()):
            if code:
                code_version(Path(code), version, directory / name / version.name)
            else:
                (directory / name / version.name).symlink_to(version.resolve(), target_is_directory=True)
        models[name] = change
    return models


def served_parameters(url: str, model: str) -> dict[str, str]:
    """`model`'s config parameters as the server loaded them."""
    with contextlib.closing(grpcclient.InferenceServerClient(url)) as client:
        config = client.get_model_config(model, as_json=True)["config"]
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def run(args: argparse.Namespace, url: str, metrics_url: str, models: dict[str, str]) -> dict:
    """Each round: {model: {k: {streams: level}}} (`triton_bench.run_level`; the 1-stream levels keep their outputs)."""
    prompts = held_out_prompts(args.checkpoint, args.prompts, args.prompt_tokens)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    draft_counts = [int(k) for k in args.draft_tokens.split(",") if k]
    result = {"benchmark": "triton_ab", "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "environment": environment(), "models": models,
              "parameters": {model: served_parameters(url, model) for model in models}, "rounds": []}
    changed = sorted({key for change in models.values() if change for key in parsed_change(change)} - {CODE})
    for model, parameters in result["parameters"].items():  # as served: the export's own values too
        print(f"triton_ab {model}: " + ", ".join(f"{key}={parameters.get(key)}" for key in changed), flush=True)
    for model in models:  # untimed: the first calls of each batch shape
        for k in draft_counts:
            for streams in levels:
                run_level(url, metrics_url, prompts, streams, streams, min(args.max_tokens, 16), k, model=model)
    order = list(models)
    for turn in range(args.rounds):
        measured: dict[str, dict[str, dict[str, dict]]] = {model: {} for model in models}
        turn_order = order[turn % len(order):] + order[: turn % len(order)]  # each round starts with another model
        for k in draft_counts:
            for streams in levels:
                requests = max(streams * args.requests_per_stream, len(prompts))
                for model in turn_order:
                    change = models[model]
                    level = run_level(url, metrics_url, prompts, streams, requests, args.max_tokens, k,
                                      keep_outputs=streams == 1, model=model)
                    measured[model].setdefault(str(k), {})[str(streams)] = level
                    print(f"triton_ab round {len(result['rounds']) + 1}, {change or 'export'}, k={k}, {streams} "
                          f"streams: {level['tokens_per_s']:.1f} tokens/s, ITL p50 {level['itl']['p50_ms']:.2f} ms",
                          flush=True)
        result["rounds"].append(measured)
        result["mean_tokens_per_s"] = mean_tokens_per_s(result["rounds"])
        write_result(args.out, result)  # what is done so far survives a time limit
    for model, by_k in result["mean_tokens_per_s"].items():
        for k, by_streams in by_k.items():
            levels_text = ", ".join(f"{streams} streams {rate:.1f}" for streams, rate in by_streams.items())
            print(f"triton_ab {models[model] or 'export'}, k={k}, tokens/s over {args.rounds} rounds: {levels_text}")
    return result


def mean_tokens_per_s(rounds: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """{model: {k: {streams: tokens/s}}}, the mean over the rounds."""
    first = rounds[0]
    return {model: {k: {streams: sum(r[model][k][streams]["tokens_per_s"] for r in rounds) / len(rounds)
                        for streams in by_streams}
                    for k, by_streams in by_k.items()}
            for model, by_k in first.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory the repository was exported from")
    parser.add_argument("--repository", required=True, help="a repository holding `spec_decode` (export --hops local)")
    parser.add_argument("--change", action="append", required=True, metavar="KEY=VALUE[,KEY=VALUE]",
                        help="spec_decode parameters changed for one model of the A/B (repeat for more)")
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--server-log", help="where the embedded server writes its log")
    parser.add_argument("--draft-tokens", default="0", help="comma-separated num_draft_tokens, each measured (default 0)")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests-per-stream", type=at_least(1), default=8)
    parser.add_argument("--rounds", type=at_least(1), default=2, help="every model at every level, this many times in turn")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ready-timeout", type=float, default=600.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the server on timeout
    from triton_mtp.serving.server import TritonServer, free_ports

    with contextlib.ExitStack() as stack:
        directory = Path(tempfile.mkdtemp(prefix="triton_ab_"))
        stack.callback(shutil.rmtree, directory, True)
        models = ab_repository(Path(args.repository), args.change, directory)
        grpc_port, http_port, metrics_port = free_ports(3)
        server = TritonServer(str(directory), grpc_port, http_port, metrics_port, log_path=args.server_log)
        server.start()
        stack.callback(server.stop, STOP_GRACE_S)
        server.wait_ready(args.ready_timeout)
        run(args, server.grpc_url, server.metrics_url, models)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
