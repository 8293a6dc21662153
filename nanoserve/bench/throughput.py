"""`nanoserve bench throughput`: nanoserve's offline generation vs transformers `generate`, same run.

Every engine gets token-id prompts of the same length (32 tokens by default; each run its own, so no
run finds its prompts in the prefix cache), greedy, a fixed number of new tokens (EOS ignored), at each
batch size; each nanoserve engine is also measured sampling (SAMPLED_TEMPERATURE, SAMPLED_TOP_P), since
users sample. Output tokens per second are reported as min/median/max over repeats. Each repeat runs
every column once, back to back (each other repeat in reverse order), and a ratio is the median (min-max) of the repeats' own ratios: on a
shared machine whose speed drifts by a third over minutes, a pair measured seconds apart is compared
under the same conditions, where two medians need not be. A second table gives,
for each nanoserve engine, the weight bytes a decode step reads and the rate it read them at, beside
this machine's read bandwidth measured in the same run (nanoserve.bench.bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve.bench.bandwidth import BUFFER_MIB, PASSES, read_bandwidth

PASSAGE = (
    "The city grew from a small river crossing into a busy market town. Merchants came from the coast "
    "with salt and cloth, farmers brought grain from the hills, and by the twelfth century the town had "
    "a cathedral, a university and a bridge of nine stone arches. Its old quarter still keeps the narrow "
    "streets, the guild halls and the covered market where traders once weighed silver on brass scales."
)


def make_prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` windows of the passage, one token apart: the same ones at every call."""
    ids = tokenizer(PASSAGE).input_ids
    ids = (ids * (prompt_len * (batch + 1) // len(ids) + 2))[: prompt_len * (batch + 1)]
    return [ids[i : i + prompt_len] for i in range(batch)]


FIRST_MARKER_ID = 256
"""Past the special tokens of the vocabularies nanoserve serves (Llama 3's and Qwen's sit at the top)."""


class FreshPrompts:
    """make_prompts' windows, each starting with a token no earlier prompt had (FIRST_MARKER_ID on): no
    run finds its prompts in the engine's prefix cache. Windows reused from run to run would skip their
    prefill after the first run, and flatter an engine whose cache holds them all over one whose cache
    cannot."""

    def __init__(self, tokenizer, prompt_len: int) -> None:
        self.tokenizer, self.prompt_len = tokenizer, prompt_len
        self.next_marker = FIRST_MARKER_ID

    def __call__(self, batch: int) -> list[list[int]]:
        if self.next_marker + batch > len(self.tokenizer):
            raise ValueError(f"the vocabulary has no {batch} more tokens to start fresh prompts with")
        prompts = make_prompts(self.tokenizer, batch, self.prompt_len)
        for prompt in prompts:
            prompt[0] = self.next_marker
            self.next_marker += 1
        return prompts


SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 0.8, 0.95
"""The sampled columns' settings: a common chat setting, whose top-p cut needs a sort of each row's head."""


def time_nanoserve(llm, prompts: list[list[int]], new_tokens: int, sampled: bool = False) -> float:
    from nanoserve.sampling_params import SamplingParams

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
    return len(prompts) * new_tokens / elapsed


def load_transformers(model_path: str, dtype: torch.dtype):
    """A plain transformers model in `dtype`. A GGUF file is dequantized in float32 first and copied
    into a fresh model, as the baselines were measured: loaded straight in bf16, transformers keeps
    GGUF weights quantized and computes through a different, slower path."""
    import os

    from transformers import AutoModelForCausalLM

    if not model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    dequantized = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    )
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(dequantized.state_dict())
    return model.eval()


def time_transformers(model, prompts: list[list[int]], new_tokens: int) -> float:
    input_ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


KV_CACHE_SUFFIXES = {"kvbf16": "bfloat16", "kvfp8": "fp8_e5m2", "kvint8": "int8"}
"""Engine-name suffixes and the --kv-cache-dtype each names."""


def nanoserve_options(name: str) -> dict:
    """`mp-int4-nokernels` -> the LLM options it names."""
    mode, *suffixes = name.split("-")
    quantizations = [s for s in suffixes if s in ("auto", "int4", "int8")]
    caches = [KV_CACHE_SUFFIXES[s] for s in suffixes if s in KV_CACHE_SUFFIXES]
    if (
        mode not in ("mp", "inproc")
        or not set(suffixes) <= {"auto", "int4", "int8", "nokernels", "unfused", *KV_CACHE_SUFFIXES}
        or len(quantizations) > 1
        or len(caches) > 1
        or {"nokernels", "unfused"} <= set(suffixes)
    ):
        raise ValueError(f"unknown engine {name!r}")
    kernels = "off" if "nokernels" in suffixes else "unfused" if "unfused" in suffixes else "auto"
    return {
        "multiprocess_mode": mode == "mp",
        "quantization": quantizations[0] if quantizations else "none",
        "cpu_kernels": kernels,
        "kv_cache_dtype": caches[0] if caches else "auto",
    }


def print_weight_rates(
    llms: dict,
    batch_sizes: list[int],
    tok_s: dict[str, list[float]],
    labels: dict[str, str],
    bandwidth: float,
) -> None:
    """Per engine and batch: MB of weights per decode step, and the GB/s that makes at the median tok/s
    (one step per batch of tokens; prefill time counts against it, so it is a lower bound), as a share
    of the read bandwidth."""
    if not llms:
        return
    print(
        f"\nweights read per decode step, and at what rate (at the median tok/s), against this machine's "
        f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (a sum over {BUFFER_MIB} MiB, best of {PASSES})"
    )
    print(f"{'batch':>5}" + "".join(f"  {labels[n]:>28}" for n in llms))
    for i, batch in enumerate(batch_sizes):
        cells = []
        for name, llm in llms.items():
            step_bytes = llm.llm_engine.engine_core.collective_rpc("weight_bytes_per_step", (batch,))[0]
            rate = step_bytes * tok_s[labels[name]][i] / batch
            cells.append(f"{step_bytes / 1e6:.1f} MB {rate / 1e9:5.1f} GB/s {rate / bandwidth:4.0%}")
        print(f"{batch:>5}" + "".join(f"  {c:>28}" for c in cells))


def summarize(samples: list[float]) -> str:
    return f"{statistics.median(samples):7.1f} ({min(samples):.0f}-{max(samples):.0f})"


def paired_ratio(tops: list[float], bottoms: list[float]) -> str:
    """The median (min-max) over repeats of top / bottom, each pair from the same repeat."""
    ratios = [top / bottom for top, bottom in zip(tops, bottoms, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench throughput", description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the bundled model)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto (the engine's default): bfloat16 on a CPU with native bf16, else float32",
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, e.g. 1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--engines",
        default="mp,transformers",
        help="comma-separated, first is the reference for ratios: mp (engine core in a child process) or "
        "inproc (same process), each optionally followed by -int4, -int8 or -auto (--quantization), "
        "-nokernels (--cpu-kernels off) or -unfused (--cpu-kernels unfused) and -kvbf16, -kvfp8 or "
        "-kvint8 (--kv-cache-dtype bfloat16, fp8_e5m2 or int8), e.g. mp-int4; and transformers",
    )
    parser.add_argument("--profile", action="store_true", help="write a torch profiler trace of a decode run")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw tok/s against batch size")
    args = parser.parse_args(argv)
    if args.plot:
        from nanoserve.bench.plot import require_matplotlib

        require_matplotlib()

    from nanoserve.entrypoints.llm import LLM
    from nanoserve.model.loader import resolve_dtype
    from nanoserve.model_files import load_tokenizer, resolve_model_path

    model_path = resolve_model_path(args.model)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    names = args.engines.split(",")
    try:
        llm_options = {n: nanoserve_options(n) for n in names if n != "transformers"}
    except ValueError as e:
        parser.error(str(e))
    tokenizer = load_tokenizer(model_path)
    llms = {n: LLM(model=model_path, dtype=dtype_name, **kw) for n, kw in llm_options.items()}
    hf_model = load_transformers(model_path, dtype) if "transformers" in names else None

    labels = {n: f"nanoserve ({n})" for n in names} | {"transformers": "transformers"}
    # each nanoserve engine greedy and sampled, transformers greedy: (column label, engine, sampled)
    columns = [
        (labels[n] + (" sampled" if sampled else ""), n, sampled)
        for n in names
        for sampled in ((False,) if n == "transformers" else (False, True))
    ]

    def run(name: str, sampled: bool, prompts: list[list[int]], new_tokens: int) -> float:
        if name == "transformers":
            return time_transformers(hf_model, prompts, new_tokens)
        return time_nanoserve(llms[name], prompts, new_tokens, sampled)

    print(
        f"model {model_path}\ndtype {dtype_name} ({args.dtype}), {torch.get_num_threads()} threads, "
        f"{args.prompt_len}-token prompts (each run its own: no prefix-cache hits), {args.new_tokens} new tokens, greedy and sampled "
        f"(temperature {SAMPLED_TEMPERATURE}, top_p {SAMPLED_TOP_P}); tok/s as median (min-max) of {args.repeats}; "
        f"ratios as median (min-max) of each repeat's own\n"
    )
    # (numerator column, denominator column, title)
    ratios = [(labels[names[0]], labels[n], f"{names[0]}/{n}") for n in names[1:]]
    ratios += [(labels[n] + " sampled", labels[n], f"{n} sampled/greedy") for n in llms]
    header = f"{'batch':>5}" + "".join(f"  {label:>24}" for label, _, _ in columns)
    header += "".join(f"  {title:>24}" for _, _, title in ratios)
    print(header)
    curves: dict[str, list[float]] = {label: [] for label, _, _ in columns}
    fresh_prompts = FreshPrompts(tokenizer, args.prompt_len)
    for batch in batch_sizes:
        samples: dict[str, list[float]] = {label: [] for label, _, _ in columns}
        for name in names:
            run(name, False, fresh_prompts(batch), 4)  # warm-up
        for repeat in range(args.repeats):  # interleaved, every other one reversed: no column always first
            for label, name, sampled in columns if repeat % 2 == 0 else columns[::-1]:
                samples[label].append(run(name, sampled, fresh_prompts(batch), args.new_tokens))
        row = f"{batch:>5}" + "".join(f"  {summarize(samples[label]):>24}" for label, _, _ in columns)
        row += "".join(f"  {paired_ratio(samples[top], samples[bottom]):>24}" for top, bottom, _ in ratios)
        print(row, flush=True)
        for label in curves:
            curves[label].append(statistics.median(samples[label]))
    print_weight_rates(llms, batch_sizes, curves, labels, read_bandwidth())
    if args.plot:
        from nanoserve.bench.plot import plot_throughput

        plot_throughput(args.plot, batch_sizes, curves)

    if args.profile and llms:
        llm = next(iter(llms.values()))
        engine = llm.llm_engine
        assert engine is not None
        prompts = make_prompts(tokenizer, batch_sizes[-1], args.prompt_len)
        engine.engine_core.profile(True)
        time_nanoserve(llm, prompts, 16)
        engine.engine_core.profile(False)
        print("profiler trace written under NANOSERVE_TORCH_PROFILER_DIR (default ./profiles)")
    for llm in llms.values():
        llm.shutdown()
