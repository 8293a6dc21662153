"""The `nanoserve` command: `nanoserve generate | serve | bench`.

Each subcommand lives in a module with `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed args). Engine options are the same flags everywhere: a subcommand calls
`add_engine_args(parser)` and builds its options with `engine_options_from_args(args)`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nanoserve.config import (
    CPU_KERNEL_MODES,
    DP_BACKENDS,
    DTYPES,
    ENGINE_ALLOCATORS,
    KV_CACHE_DTYPES,
    MATMUL_CHOICES,
    QUANTIZATIONS,
    RAY_PLACEMENT_STRATEGIES,
    RUNNERS,
    SPECULATIVE_METHODS,
    EngineOptions,
)

SUBCOMMANDS: dict[str, str] = {
    "generate": "nanoserve.entrypoints.cli",
    "serve": "nanoserve.entrypoints.serve",
    "bench": "nanoserve.bench.cli",
}
"""Subcommand -> module defining `register(subparsers)`."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine option flags; dest names are EngineOptions fields, and an absent flag keeps its default."""
    group = parser.add_argument_group("engine options")
    group.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M)"
    )
    group.add_argument("--dtype", choices=DTYPES, default=None)
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="auto: the model's dtype; bfloat16: under a float32 model, half its KV bytes (twice the cached "
        "tokens, faster long-context decode), K and V rounded to bf16; int8 or fp8_e5m2: a byte per value "
        "under any model (about twice bf16's tokens): int8 codes with a scale per token and head (close to "
        "bf16), or 8-bit floats (2 mantissa bits)",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    group.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None
    )
    group.add_argument(
        "--seed", type=int, default=None, help="engine seed, also the sampling seed of generate"
    )
    group.add_argument(
        "--multiprocess",
        dest="multiprocess_mode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine core in a child process (default: on unless NANOSERVE_ENABLE_MULTIPROCESSING=0)",
    )
    group.add_argument("--device", default=None, help="auto, cpu or cuda")
    group.add_argument("--num-threads", type=int, default=None)
    group.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="int4 / int8: quantized weights for decode (CPU); auto: a GGUF file's own Q4_0/Q4_1/Q8_0 codes "
        "(none for HF folders)",
    )
    group.add_argument(
        "--cpu-kernels",
        choices=CPU_KERNEL_MODES,
        default=None,
        help="auto: C++ kernels on CPU where they build, decode (and prefill) steps of Llama- and "
        "Gemma-shaped models and mixtures of experts fused into one C++ call; unfused: the same kernels "
        "called from the PyTorch modules; off: PyTorch ops only",
    )
    group.add_argument(
        "--matmul-choice",
        choices=MATMUL_CHOICES,
        default=None,
        help="auto measures per CPU and weight shape (cached) up to which step size each quantized matmul "
        "beats the unquantized one, how far ahead it prefetches weights, and oneDNN's fastest bf16 layout; "
        "fixed: quantized at every step size, 4 KB ahead, batch 1's layout",
    )
    group.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="ngram: speculative decoding by prompt lookup (same output, fewer steps where the text "
        "repeats its context)",
    )
    group.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="draft tokens per step (default 3)"
    )
    group.add_argument("--prompt-lookup-max", type=int, default=None, help="longest n-gram matched (4)")
    group.add_argument("--prompt-lookup-min", type=int, default=None, help="shortest n-gram matched (2)")
    group.add_argument("--runner", choices=RUNNERS, default=None)
    group.add_argument(
        "--engine-allocator",
        choices=ENGINE_ALLOCATORS,
        default=None,
        help="malloc of the engine-core processes: jemalloc (preloaded; 512-token prefills 5-14%% faster "
        "on an AMX Xeon), system, or auto: jemalloc where it is installed and the engine is spawned",
    )
    group.add_argument(
        "--engine-restarts",
        type=int,
        default=None,
        help="restart a dead engine core up to N times per --engine-restart-window, resuming its requests "
        "(default 0: a death is final)",
    )
    group.add_argument(
        "--engine-restart-window",
        type=float,
        default=None,
        help="seconds over which --engine-restarts is counted (default 600)",
    )
    group.add_argument(
        "--data-parallel-size", type=int, default=None, help="number of engine-core replicas (default 1)"
    )
    group.add_argument(
        "--data-parallel-rank",
        type=int,
        default=None,
        help="with --data-parallel-external-lb: the one rank this frontend serves",
    )
    group.add_argument(
        "--data-parallel-external-lb",
        action="store_true",
        default=None,
        help="one rank per frontend, balanced by an external load balancer",
    )
    group.add_argument(
        "--data-parallel-backend",
        choices=DP_BACKENDS,
        default=None,
        help="mp: engine-core child processes (default); ray: Ray actors, on this machine or a Ray cluster",
    )
    group.add_argument(
        "--ray-address", default=None, help="with --data-parallel-backend ray: the Ray cluster to join"
    )
    group.add_argument(
        "--ray-placement-strategy",
        choices=RAY_PLACEMENT_STRATEGIES,
        default=None,
        help="with --data-parallel-backend ray: PACK ranks onto few nodes (default), or STRICT_SPREAD one per "
        "node, ...",
    )
    group.add_argument(
        "--ray-ship-model",
        action="store_true",
        default=None,
        help="with --data-parallel-backend ray: send the model through Ray's object store to every node "
        "(up to 2 GiB) instead of reading it at the same path there",
    )
    group.add_argument(
        "--zmq-curve",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="authenticate and encrypt the engine sockets over TCP with CurveZMQ (default: on); "
        "--no-zmq-curve sends plaintext, for a trusted network only",
    )


def engine_options_from_args(args: argparse.Namespace) -> EngineOptions:
    fields = EngineOptions.__dataclass_fields__
    kwargs = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    return EngineOptions(**kwargs)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate from one prompt, streaming to stdout")
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine = LLMEngine(engine_options_from_args(args))
    try:
        prompt = args.prompt
        if args.chat:
            prompt = engine.processor.render_chat([{"role": "user", "content": args.prompt}])
        engine.add_request("generate", prompt, params)
        num_printed = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                if completion.error is not None:
                    print(f"\nerror: {completion.error}", file=sys.stderr)
                    return 1
                sys.stdout.write(completion.text[num_printed:])
                sys.stdout.flush()
                num_printed = len(completion.text)
        sys.stdout.write("\n")
        return 0
    finally:
        engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A compact LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
