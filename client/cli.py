"""`triton-mtp generate`: one completion from a running server, over gRPC (default) or HTTP.

Text goes to stdout (as it arrives with --stream), a summary line to stderr; --json prints one JSON
object with every response field instead. Exit codes: 0 done, 1 the server or the connection failed
(its message on stderr), 2 bad usage, 130 interrupted (the request is cancelled on the server).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Iterator

from .core import Client
from .errors import TritonMTPError
from .types import Completion, Delta

PROG = "triton-mtp generate"


def summary(completion: Completion, elapsed_s: float) -> str:
    """`12 tokens in 0.50 s (24.0 tokens/s), finish length, acceptance 41.7% (5/12), mean accepted length 1.83`."""
    tokens = completion.usage.output_tokens
    stats = completion.acceptance
    rate = tokens / max(elapsed_s, 1e-9)
    line = f"{tokens} tokens in {elapsed_s:.2f} s ({rate:.1f} tokens/s), finish {completion.finish_reason}"
    if stats.acceptance_rate is None:
        return line + ", no drafts"
    length = "n/a" if stats.mean_accepted_length is None else f"{stats.mean_accepted_length:.2f}"
    return (
        f"{line}, acceptance {100 * stats.acceptance_rate:.1f}% ({stats.accepted_draft_tokens}/{stats.draft_tokens}),"
        f" mean accepted length {length}"
    )


def read_prompt(value: str) -> str:
    prompt = sys.stdin.read() if value == "-" else value
    if not prompt:
        raise ValueError("PROMPT is empty" + (" (nothing on stdin)" if value == "-" else ""))
    return prompt


def run(args: argparse.Namespace) -> int:
    options = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        num_draft_tokens=args.num_draft_tokens,
        stop=args.stop,
        return_logprobs=args.logprobs,
    )
    started = time.monotonic()
    try:
        prompt = read_prompt(args.prompt)
        with Client(args.url, protocol=args.protocol, timeout=args.timeout, model=args.model,
                    retries=args.retries) as client:
            if args.stream and not args.json:
                completion = print_stream(client.stream(prompt, **options))
            else:
                completion = client.generate(prompt, **options)
                if not args.json:
                    print(completion.text, flush=True)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except TritonMTPError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted, request cancelled", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(completion.as_dict()))
    else:
        print(summary(completion, time.monotonic() - started), file=sys.stderr)
    return 0


def print_stream(items: Iterator[Delta | Completion]) -> Completion:
    """Write each delta's text to stdout as it arrives; return the final Completion."""
    completion = None
    for item in items:
        if isinstance(item, Completion):
            completion = item
        else:
            sys.stdout.write(item.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return completion


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a completion from a running server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", metavar="PROMPT", help="prompt text, or - to read it from stdin")
    parser.add_argument("--url", help="host:port (default localhost:8001 for grpc, localhost:8000 for http)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model", default="spec_decode", help="Triton model name (default spec_decode)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, help="0 is greedy (the server's default)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--num-draft-tokens", type=int, help="draft tokens per step (default: the server's)")
    parser.add_argument("--stop", action="append", metavar="TEXT", help="stop word; repeat for several")
    parser.add_argument("--logprobs", action="store_true", help="return the log-probability of each token")
    parser.add_argument("--stream", action="store_true", help="print text as each decoding step arrives")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every response field")
    parser.add_argument("--timeout", type=float, help="seconds before the request is cancelled")
    parser.add_argument("--retries", type=int, default=0,
                        help="resend the request this many times while the server is unavailable before the first token")
    parser.set_defaults(func=run)
