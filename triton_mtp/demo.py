"""`make demo`: export the bundled checkpoint, serve it with the embedded tritonserver, and stream the
completion of a held-out code prompt with its acceptance statistics.

    python -m triton_mtp.demo [--checkpoint DIR] [--max-tokens N] [--num-draft-tokens K] [--repository DIR]

The repository is written once into `build/demo-repository` (again when the checkpoint, the device or
torch changes). CUDA is used when present (bf16), the CPU otherwise (fp32).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from triton_mtp.client import Client, Completion
from triton_mtp.client.cli import print_stream, summary
from triton_mtp.export.repository import MANIFEST, write_repository
from triton_mtp.serving.requests import TokenizerFile
from triton_mtp.serving.server import TritonServer, free_ports
from triton_mtp.train.acceptance import held_out_prompts

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "models" / "tiny-dsv3-mtp"
REPOSITORY = ROOT / "build" / "demo-repository"
PROMPT_TOKENS, MAX_SEQ_LEN = 96, 512


def repository_for(checkpoint: Path, repository: Path, device: str) -> Path:
    """`repository` exported from `checkpoint` for `device`, reusing an earlier export that matches."""
    manifest = repository / MANIFEST
    if manifest.is_file():
        found = json.loads(manifest.read_text())
        if (found["checkpoint"], found["device"], found["torch_version"]) == (
                str(checkpoint.resolve()), device, torch.__version__):
            return repository
    print(f"exporting {checkpoint} to {repository} ({device})", flush=True)
    write_repository(checkpoint, repository, device=device,
                     dtype="bf16" if device == "cuda" else "fp32", max_slots=4, max_seq_len=MAX_SEQ_LEN,
                     progress=True, log=lambda line: None)
    return repository


def acceptance_table(completion: Completion) -> str:
    """Accepted drafts per draft position, as counts and rates of the drafting steps."""
    stats = completion.acceptance
    if not stats.draft_tokens or stats.steps <= 0:
        return "no drafts"
    return "accepted per draft position: " + ", ".join(
        f"{k + 1}: {n}/{stats.steps} ({n / stats.steps:.2f})" for k, n in enumerate(stats.accepted_per_position))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--repository", type=Path, default=REPOSITORY)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    repository = repository_for(args.checkpoint, args.repository, device)
    tokenizer = TokenizerFile(args.checkpoint / "tokenizer.json")
    prompt = tokenizer.decode(held_out_prompts(tokenizer, 1, PROMPT_TOKENS)[0])
    grpc_port, http_port, metrics_port = free_ports(3)
    with TritonServer(repository, grpc_port, http_port, metrics_port) as server:
        print(f"tritonserver ready: grpc {server.grpc_url}, http {server.http_url}, metrics {server.metrics_url}")
        print(f"--- held-out prompt ({PROMPT_TOKENS} tokens) ---\n{prompt}\n--- completion ---", flush=True)
        with Client(server.grpc_url, timeout=600) as client:
            started = time.monotonic()
            completion = print_stream(client.stream(prompt, max_tokens=args.max_tokens,
                                                    num_draft_tokens=args.num_draft_tokens))
            elapsed = time.monotonic() - started
    print("---")
    print(summary(completion, elapsed))
    print(acceptance_table(completion))
    return 0


if __name__ == "__main__":
    sys.exit(main())
