"""`nanoserve bench families`: how long each model family takes to load, each family's decode throughput
against the Llama of the same shape (whether its layers keep the fast paths: the fused decode step, the
kernels), and what a mixture-of-experts model's decode throughput is against the dense model with as many
active parameters.

The models are built here with transformers from one shape (random weights, bf16 safetensors, the
bundled model's tokenizer) in a temporary folder: nothing is downloaded. The MoE comparison pairs a
Mixtral-style model (8 experts, top-2, each expert half the dense MLP's width) with a Llama whose MLP is
as wide as the two chosen experts together, so every token does the same matmul work in both; the MoE
then pays only for routing and for grouping tokens per expert. The same pair of blocks is also timed
alone (one SparseMoE against one GatedMLP forward, and the SparseMoE's experts on tokens already grouped:
the rest is routing and grouping) to show where a difference comes from.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import cast

import torch

from nanoserve.model.layers.causal_lm import CausalLM

SHAPE = dict(
    vocab_size=49152,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)
KV_CACHE_BYTES = 256 << 20
"""Each engine's KV cache, of which two are alive at once: the default GiB, written ahead of serving, is
far more than a batch of 32 prompts and 64 new tokens need."""
NUM_EXPERTS, TOP_K = 8, 2
MOE = dict(num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, intermediate_size=512)
QWEN_MOE = dict(num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=512)
GEMMA = dict(head_dim=64, query_pre_attn_scalar=64, hidden_activation="gelu_pytorch_tanh")
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", dict(sliding_window=1024)),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", dict(head_dim=64)),
    "phi3": ("Phi3", dict(num_key_value_heads=8)),
    "phi4": ("Phi3", dict(num_key_value_heads=8, partial_rotary_factor=0.75)),
    "gemma2": ("Gemma2", GEMMA | dict(sliding_window=1024)),
    "gemma3": ("Gemma3Text", GEMMA | dict(sliding_window=512)),
    "mixtral": ("Mixtral", MOE),
    "qwen2-moe": ("Qwen2Moe", QWEN_MOE | dict(shared_expert_intermediate_size=512)),
    "qwen3-moe": ("Qwen3Moe", QWEN_MOE | dict(head_dim=64, norm_topk_prob=True)),
}
"""family -> (transformers name prefix, changes to SHAPE). The dense llama and the mixtral share every
dimension but the MLP's."""


def build(family: str, folder: Path) -> Path:
    import transformers

    from nanoserve.model_files import load_tokenizer, resolve_model_path

    prefix, changes = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**(SHAPE | changes))
    model_class = "Gemma3ForCausalLM" if prefix == "Gemma3Text" else f"{prefix}ForCausalLM"
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).to(torch.bfloat16).save_pretrained(folder)
    load_tokenizer(resolve_model_path(None)).save_pretrained(folder)
    return folder


def time_load(path: str, repeats: int) -> tuple[int, float]:
    """(parameters, median seconds to read the config and load the weights in bf16)."""
    from nanoserve.model.loader import load_model, load_model_config

    seconds, num_params = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        model = load_model(path, load_model_config(path), torch.bfloat16, torch.device("cpu"))
        seconds.append(time.perf_counter() - start)
        num_params = sum(p.numel() for p in model.parameters())
    return num_params, statistics.median(seconds)


def time_forward(forward, repeats: int = 100) -> float:
    """Microseconds per call, the best of 5 runs of `repeats`."""
    with torch.inference_mode():
        for _ in range(10):
            forward()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                forward()
            best = min(best, (time.perf_counter() - start) / repeats * 1e6)
    return best


def time_blocks(moe, mlp, tokens: int) -> tuple[float, float, float]:
    """Microseconds per forward of the SparseMoE block, of its experts' matmuls alone on tokens already
    grouped (the difference is routing and grouping), and of the dense GatedMLP."""
    x = torch.randn(tokens, SHAPE["hidden_size"], dtype=torch.bfloat16)
    with torch.inference_mode():
        _, experts = moe.route(x)
        counts = torch.bincount(experts.flatten(), minlength=NUM_EXPERTS).tolist()
        grouped = x.index_select(0, experts.flatten().argsort(stable=True) // TOP_K).split(counts)
    work = [
        (expert, rows.contiguous()) for expert, rows in zip(moe.experts, grouped, strict=True) if len(rows)
    ]
    experts_alone = time_forward(lambda: [expert(rows) for expert, rows in work])
    return time_forward(lambda: moe(x)), experts_alone, time_forward(lambda: mlp(x))


def against_llama(
    folders: dict[str, str], families: list[str], batches: list[int], args: argparse.Namespace
) -> None:
    """Each family's decode tok/s beside the same-shape llama's, the two taking turns, in-process."""
    from nanoserve.bench.throughput import FreshPrompts, paired_ratio, summarize, time_nanoserve
    from nanoserve.entrypoints.llm import LLM

    def engine(family: str) -> LLM:
        return LLM(
            folders[family],
            dtype=args.dtype,
            quantization=args.quantization,
            multiprocess_mode=False,
            num_threads=args.num_threads,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
        )

    print(f"\neach family against llama of the same shape ({args.dtype}, quantization {args.quantization}); "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, in-process engine")  # fmt: skip
    print(
        f"{'family':>10}  {'fused':>5}  {'batch':>5}  {'tok/s':>18}  {'llama tok/s':>18}  {'family/llama':>18}"
    )
    llama = engine("llama")
    fresh_prompts = FreshPrompts(llama.get_tokenizer(), args.prompt_len)
    for family in families:
        llm = engine(family)
        fused = "yes" if in_process_model(llm).fused_decoder is not None else "no"
        for batch in batches:
            samples: dict[str, list[float]] = {"family": [], "llama": []}
            for one in (llm, llama):
                time_nanoserve(one, fresh_prompts(batch), 4)  # warm-up
            for _ in range(args.repeats):  # taking turns, so drift on a shared machine hits both alike
                samples["family"].append(time_nanoserve(llm, fresh_prompts(batch), args.new_tokens))
                samples["llama"].append(time_nanoserve(llama, fresh_prompts(batch), args.new_tokens))
            ratio = paired_ratio(samples["family"], samples["llama"])
            print(f"{family:>10}  {fused:>5}  {batch:>5}  {summarize(samples['family']):>18}  "
                  f"{summarize(samples['llama']):>18}  {ratio:>18}", flush=True)  # fmt: skip
        llm.shutdown()
    llama.shutdown()


def in_process_model(llm) -> CausalLM:
    """An in-process LLM's model: pre-packed, C++ kernels on."""
    return llm.llm_engine.engine_core.engine_core.runner.model


def first_mlp(llm) -> torch.nn.Module:
    """Layer 0's MLP (SparseMoE or GatedMLP) of an in-process LLM's model."""
    return cast(torch.nn.Module, in_process_model(llm).layers[0].mlp)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench families", description=__doc__)
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated, of: " + ", ".join(FAMILIES)
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="for the throughput tables")
    parser.add_argument("--dtype", default="bfloat16", help="of the families against llama")
    parser.add_argument(
        "--quantization", default="none", help="of the families against llama: none, int4, int8"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--skip-throughput", action="store_true", help="load times only")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")

    from nanoserve.bench.throughput import FreshPrompts, summarize, time_nanoserve
    from nanoserve.entrypoints.llm import LLM

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-families-") as tmp:
        folders = {f: str(build(f, Path(tmp) / f)) for f in dict.fromkeys([*families, "llama", "mixtral"])}
        print(f"{torch.get_num_threads()} threads; models of {SHAPE['num_hidden_layers']} layers, hidden "
              f"{SHAPE['hidden_size']}, random bf16 weights\n")  # fmt: skip
        print(f"{'family':>10}  {'parameters':>10}  {'load s (median)':>15}")
        for family in families:
            num_params, seconds = time_load(folders[family], args.repeats)
            print(f"{family:>10}  {num_params / 1e6:>9.1f}M  {seconds:>15.2f}", flush=True)
        if args.skip_throughput:
            return
        batches = [int(b) for b in args.batch_sizes.split(",")]
        against_llama(folders, [f for f in families if f != "llama"], batches, args)

        print(f"\nmixtral ({NUM_EXPERTS} experts, top-{TOP_K}) against llama with the same active parameters; "
              f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, in-process engine")  # fmt: skip
        print(f"{'batch':>5}  {'llama tok/s':>18}  {'mixtral tok/s':>18}  {'moe/dense':>9}  "
              f"{'MoE block us':>12}  {'its experts us':>14}  {'dispatch':>8}  {'MLP block us':>12}")  # fmt: skip
        llms = {
            f: LLM(
                folders[f],
                dtype="bfloat16",
                multiprocess_mode=False,
                num_threads=args.num_threads,
                kv_cache_memory_bytes=KV_CACHE_BYTES,
            )
            for f in ("llama", "mixtral")
        }
        fresh_prompts = FreshPrompts(llms["llama"].get_tokenizer(), args.prompt_len)
        for batch in batches:
            samples: dict[str, list[float]] = {f: [] for f in llms}
            for llm in llms.values():
                time_nanoserve(llm, fresh_prompts(batch), 4)  # warm-up
            for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
                for family, llm in llms.items():
                    samples[family].append(time_nanoserve(llm, fresh_prompts(batch), args.new_tokens))
            ratio = statistics.median(samples["mixtral"]) / statistics.median(samples["llama"])
            moe_us, experts_us, mlp_us = time_blocks(
                first_mlp(llms["mixtral"]), first_mlp(llms["llama"]), batch
            )
            print(f"{batch:>5}  {summarize(samples['llama']):>18}  {summarize(samples['mixtral']):>18}  "
                  f"{ratio:>8.2f}x  {moe_us:>12.0f}  {experts_us:>14.0f}  {1 - experts_us / moe_us:>8.0%}  "
                  f"{mlp_us:>12.0f}", flush=True)  # fmt: skip
        for llm in llms.values():
            llm.shutdown()
