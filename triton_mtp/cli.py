"""`triton-mtp` command line: each subcommand lives next to the code it drives."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `register(subparsers)`; each sets `func` on its parser.
SUBCOMMANDS = {
    "export": "triton_mtp.export.cli",
    "serve": "triton_mtp.serving.server",
    "generate": "triton_mtp.client.cli",
    "train": "triton_mtp.train.cli",
    "eval-acceptance": "triton_mtp.train.acceptance",
    "bench": "triton_mtp.bench.triton_bench",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triton-mtp", description=__doc__.split(":")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, module in SUBCOMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name)
            continue
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if not module.startswith(exc.name or "\0"):
                raise
            sub.add_parser(name, help="(not installed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if not hasattr(args, "func"):
        print(f"triton-mtp: '{args.command}' is not available in this installation", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
