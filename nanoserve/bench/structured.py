"""`nanoserve bench structured`: what a JSON schema costs, tok/s with and without it, same run.

Both sides decode the same token-id prompts greedily for the same number of new tokens (EOS ignored).
The schema (an object holding an array of at least 1000 short strings) cannot be complete before
`--new-tokens`, so every constrained request runs to its limit too. The first constrained request,
which loads the grammar engine's view of the tokenizer, runs before the timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from nanoserve.bench.throughput import FreshPrompts

SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000}
    },
    "required": ["notes"],
}


def tokens_per_second(llm, prompts: list[list[int]], new_tokens: int, structured: bool) -> float:
    from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=spec)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    return len(prompts) * new_tokens / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench structured", description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the bundled model)")
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from nanoserve.entrypoints.llm import LLM

    llm = LLM(args.model)
    try:
        fresh_prompts = FreshPrompts(llm.get_tokenizer(), args.prompt_len)
        tokens_per_second(llm, fresh_prompts(1), 4, structured=True)  # warm-up
        print("| batch | plain tok/s | json schema tok/s | schema / plain |")
        print("|------:|------------:|------------------:|---------------:|")
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            plain, constrained = [], []
            for _ in range(args.repeats):  # interleaved, so drifting load hits both alike
                plain.append(tokens_per_second(llm, fresh_prompts(batch), args.new_tokens, structured=False))
                constrained.append(
                    tokens_per_second(llm, fresh_prompts(batch), args.new_tokens, structured=True)
                )
            p, c = statistics.median(plain), statistics.median(constrained)
            print(f"| {batch} | {p:.1f} | {c:.1f} | {c / p:.2f}x |", flush=True)
    finally:
        llm.shutdown()
