"""`triton-mtp export`: checkpoint directory -> Triton model repository (export/repository.py)."""

from __future__ import annotations

import argparse
import sys

from triton_mtp.export.formats import HOPS
from triton_mtp.export.graphs import DTYPES, FORMATS
from triton_mtp.export.kernel_choice import DECODE_KERNELS, DEFAULT_DECODE_KERNELS, parse_decode_kernels
from triton_mtp.export.moe import MOE_KINDS
from triton_mtp.export.repository import DEVICES, SWITCH_INTERVAL_US, write_repository


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a DeepSeek-V3 checkpoint (with MTP layers) into a Triton model repository",
        description="Load a Hugging Face DeepSeek-V3 checkpoint, export the target and MTP step graphs, "
        "check them against eager, and write the target / mtp / spec_decode models.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="config.json + *.safetensors (+ tokenizer.json)")
    parser.add_argument("--repository", required=True, metavar="DIR", help="model repository to write")
    parser.add_argument("--format", choices=FORMATS,
                        help="artifact format (default: eager on cuda, whose decode calls replay CUDA graphs; "
                        "torchscript on cpu)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="device the models run on (default: cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="weight dtype (default: fp32)")
    parser.add_argument("--max-slots", type=at_least(1), default=4, metavar="N",
                        help="sequences served at once: KV pool slots (default: 4)")
    parser.add_argument("--max-seq-len", type=at_least(4), default=None, metavar="N",
                        help="tokens per sequence, prompt included (default: the config's max_position_embeddings)")
    parser.add_argument("--max-draft-tokens", type=at_least(1), default=4, metavar="K",
                        help="most draft tokens per step; the verify window is K + 1 (default: 4)")
    parser.add_argument("--default-num-draft-tokens", type=at_least(0), default=None, metavar="K",
                        help="draft tokens when a request names none (default: the number of MTP layers, at most K)")
    parser.add_argument("--max-queue-size", type=at_least(1), default=64, metavar="N",
                        help="requests waiting for a free slot before new ones are refused (default: 64)")
    parser.add_argument("--max-prompt-bytes", type=at_least(1), metavar="N",
                        help="text_input bytes refused before tokenizing (default: 16 x max_seq_len)")
    parser.add_argument("--max-prompt-tokens", type=at_least(1), metavar="N",
                        help="prompt tokens accepted (default: max_seq_len - 1)")
    parser.add_argument("--max-output-tokens", type=at_least(1), metavar="N",
                        help="largest max_tokens a request may ask for (default: max_seq_len - 1)")
    parser.add_argument("--request-timeout", type=float, metavar="SECONDS",
                        help="a request still queued or generating after this fails; 0 = none (default: 600)")
    parser.add_argument("--no-compile", action="store_true",
                        help="eager format: skip torch.compile when the server loads the model "
                        "(a model replaying decode graphs skips it unless --compile-graphs)")
    parser.add_argument("--compile-graphs", action="store_true",
                        help="eager format on cuda: capture the decode graphs over torch.compile'd steps (fused "
                        "kernels: a faster step, minutes more to load)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="eager format on cuda: run every target / mtp call from Python instead of replaying "
                        "captured decode graphs")
    parser.add_argument("--prefill-graph-tokens", type=at_least(0), default=256, metavar="N",
                        help="with CUDA graphs: prompt calls of up to N tokens (rows x padded prompt length) "
                        "replay graphs too, in power-of-two widths from 16; 0 runs prompts eager (default: 256)")
    parser.add_argument("--decode-steps", type=at_least(1), default=1, metavar="N",
                        help="--hops local: a call over greedy rows without drafts runs N target steps, one graph "
                        "replay for N tokens of every row (multi-step decoding; default: 1)")
    parser.add_argument("--response-threads", type=at_least(0), default=0, metavar="N",
                        help="spec_decode sends streamed responses from N threads while the next step runs; "
                        "0 sends them from the engine's step (default: 0)")
    parser.add_argument("--response-lag-steps", type=at_least(0), default=0, metavar="N",
                        help="with --response-threads: after each target call it reads (once a step), the engine "
                        "waits for the responses queued N + 1 calls before, so sending overlaps N + 1 steps (default: 0)")
    parser.add_argument("--stream-interval", type=at_least(1), default=1, metavar="N",
                        help="a streamed request gets a response once N of its tokens are unsent (its first at "
                        "once): fewer responses, each a round trip to the server, under load (default: 1, every step)")
    parser.add_argument("--spec-disable-rows", type=at_least(0), default=0, metavar="N",
                        help="steps with more than N live sequences decode without drafts, where verifying drafts "
                        "costs more than it saves (default: 0, always draft)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="--hops local: run one target call at a time instead of launching the next plain "
                        "decoding step's call before reading this one's (default: overlap)")
    parser.add_argument("--no-separate-prefill", action="store_true",
                        help="--hops local: prefill requests admitted while others decode in the decoding rows' call "
                        "instead of a call of their own (default: apart, so the decoding rows stay in their decode "
                        "graphs and chains)")
    parser.add_argument("--switch-interval-us", type=at_least(0), default=SWITCH_INTERVAL_US, metavar="US",
                        help="Python's thread switch interval in spec_decode's process: how long the engine's thread "
                        "may wait for the GIL while the response threads and request parsing hold it; 0 keeps "
                        f"Python's 5 ms (default: {SWITCH_INTERVAL_US})")
    parser.add_argument("--tensor-parallel", type=at_least(1), default=1, metavar="N",
                        help="eager format: shard the target and MTP over N ranks, one per GPU (default: 1)")
    parser.add_argument("--hops", choices=HOPS, default="bls",
                        help="bls: spec_decode calls the target and mtp models (default); local: spec_decode runs "
                        "them in its own process, no hop per call (one GPU, the repository has spec_decode only)")
    parser.add_argument("--moe", choices=MOE_KINDS, default=None,
                        help="routed experts: grouped (grouped_mm over the picked experts; eager format) or dense (every "
                        "expert on every token); default grouped on CUDA where grouped_mm runs (bf16, sm90+), else dense")
    parser.add_argument("--decode-kernels", type=kernel_names, default=DEFAULT_DECODE_KERNELS, metavar="NAMES",
                        help="eager format on CUDA: the decode paths that run Triton kernels, comma-separated from "
                        f"{', '.join(DECODE_KERNELS)}, or none (default: {','.join(DEFAULT_DECODE_KERNELS)}; the "
                        "others are off until measured on a GPU, docs/benchmarks.md)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        manifest = write_repository(
            args.checkpoint, args.repository, fmt=args.format, device=args.device, dtype=args.dtype,
            max_slots=args.max_slots, max_seq_len=args.max_seq_len, max_draft_tokens=args.max_draft_tokens,
            default_num_draft_tokens=args.default_num_draft_tokens, max_queue_size=args.max_queue_size,
            request_limits={"max_prompt_bytes": args.max_prompt_bytes, "max_prompt_tokens": args.max_prompt_tokens,
                            "max_output_tokens": args.max_output_tokens, "request_timeout_s": args.request_timeout},
            eager_compile=not args.no_compile, cuda_graphs=not args.no_cuda_graphs, compile_graphs=args.compile_graphs,
            prefill_graph_tokens=args.prefill_graph_tokens,
            decode_steps=args.decode_steps,
            response_threads=args.response_threads,
            response_lag_steps=args.response_lag_steps,
            stream_interval=args.stream_interval,
            spec_disable_rows=args.spec_disable_rows,
            overlap=not args.no_overlap,
            separate_prefill=not args.no_separate_prefill,
            switch_interval_us=args.switch_interval_us,
            tensor_parallel=args.tensor_parallel,
            hops=args.hops,
            moe=args.moe,
            decode_kernels=args.decode_kernels,
        )
    except (ValueError, OSError) as exc:
        print(f"triton-mtp export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(f"wrote {args.repository} ({manifest['format']}, {len(manifest['artifacts'])} graphs)")
    return 0


def kernel_names(text: str) -> tuple[str, ...]:
    """An argparse `type`: `parse_decode_kernels`, its error as argparse's."""
    try:
        return parse_decode_kernels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def at_least(low: int):
    """An argparse `type`: an integer of at least `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse
