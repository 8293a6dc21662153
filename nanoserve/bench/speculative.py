"""`nanoserve bench speculative`: plain decoding against n-gram speculative decoding, same run.

Two workloads, greedy, EOS ignored: a chat request asking to summarise a passage (the reply quotes
it, so prompt lookup drafts well), and `bench throughput`'s 32-token prompts at each batch size (to
show speculation backing off where its drafts do not pay). Both engines run in this process, so the
scheduler's draft/accepted counts can be read. "same ids" compares the two engines' tokens: in float32
they are identical; in bfloat16 the matmuls of a verification step see more rows than a one-token decode
step, and a kernel chosen by step size may round differently, so a near tie can fall the other way (as it
can between batch sizes without speculation).
"""

from __future__ import annotations

import argparse
import statistics
import time

from nanoserve.bench.throughput import PASSAGE, make_prompts, summarize

SUMMARY_REQUEST = "Summarise the following text in a few sentences, keeping its wording.\n\n"


def summary_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": SUMMARY_REQUEST + PASSAGE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def timed_generate(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tok/s and the generated ids."""
    from nanoserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(prompts) * new_tokens / elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def draft_counts(llm) -> tuple[int, int]:
    """(draft tokens verified, accepted) since the engine started."""
    from nanoserve.engine.core_client.inproc import InprocClient

    client = llm.llm_engine.engine_core
    assert isinstance(client, InprocClient)
    stats = client.engine_core.scheduler.get_stats()
    return stats.num_draft_tokens, stats.num_accepted_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench speculative", description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the bundled model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-sizes", default="1,8,32", help="for the 32-token prompts")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    args = parser.parse_args(argv)

    from nanoserve.entrypoints.llm import LLM
    from nanoserve.model_files import load_tokenizer, resolve_model_path

    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    common = dict(dtype=args.dtype, multiprocess_mode=False)
    plain = LLM(model_path, **common)
    drafted = LLM(
        model_path, **common, speculative="ngram", num_speculative_tokens=args.num_speculative_tokens
    )
    workloads = [("summarise", [summary_prompt(tokenizer)])]
    workloads += [
        (f"32-token x{b}", make_prompts(tokenizer, b, 32)) for b in map(int, args.batch_sizes.split(","))
    ]

    print(f"model {model_path}, {args.dtype}, {args.new_tokens} new tokens, greedy; tok/s median (min-max)")
    print(f"{'workload':>16}  {'plain':>16}  {'ngram':>16}  {'speed-up':>8}  {'accepted':>9}  same ids")
    for name, prompts in workloads:
        timed_generate(plain, prompts, 4)  # warm-up
        timed_generate(drafted, prompts, 4)
        samples: dict[str, list[float]] = {"plain": [], "ngram": []}
        before = draft_counts(drafted)
        same = True
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
            rate, expected = timed_generate(plain, prompts, args.new_tokens)
            samples["plain"].append(rate)
            rate, got = timed_generate(drafted, prompts, args.new_tokens)
            samples["ngram"].append(rate)
            same = same and got == expected
        num_drafts, num_accepted = (
            now - then for now, then in zip(draft_counts(drafted), before, strict=True)
        )
        ratio = statistics.median(samples["ngram"]) / statistics.median(samples["plain"])
        accepted = f"{num_accepted}/{num_drafts}" if num_drafts else "none"
        print(
            f"{name:>16}  {summarize(samples['plain']):>16}  {summarize(samples['ngram']):>16}  "
            f"{ratio:>7.2f}x  {accepted:>9}  {'yes' if same else 'NO'}",
            flush=True,
        )
    plain.shutdown()
    drafted.shutdown()
