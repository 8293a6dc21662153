"""Drive an EngineCore step by step, and transformers' greedy ids to compare it with."""

from __future__ import annotations

import random

import torch

from nanoserve.config import EngineOptions
from nanoserve.core.engine_core import EngineCore
from nanoserve.sampling_params import SamplingParams
from nanoserve.wire.messages import EngineCoreRequest

MAX_TOKENS = 10


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # eager: transformers' reference attention (its SDPA path drops Gemma 2's soft-capping)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def make_prompts(num: int, seed: int = 0, lengths=(3, 17, 40, 9, 28, 5)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(lengths[i % len(lengths)])] for i in range(num)]


def request(rid: str, prompt: list[int], **params) -> EngineCoreRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", MAX_TOKENS)
    params.setdefault("ignore_eos", True)
    return EngineCoreRequest(rid, prompt, SamplingParams(**params), eos_token_ids=[2])


def run_to_completion(engine: EngineCore, max_steps: int = 2000) -> dict[str, list]:
    """Step until idle; returns request id -> [token ids, finish reason, error, num_cached_tokens]."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        for out in engine.step().outputs:
            entry = results.setdefault(out.request_id, [[], None, None, 0])
            entry[0].extend(out.new_token_ids)
            entry[3] = max(entry[3], out.num_cached_tokens)
            if out.finish_reason is not None:
                entry[1], entry[2] = out.finish_reason, out.error
        engine.post_step()
    raise AssertionError("engine did not go idle")


def tiny_engine(model_dir, **options) -> EngineCore:
    options.setdefault("dtype", "float32")
    options.setdefault("block_size", 4)
    options.setdefault("num_kv_blocks", 256)
    return EngineCore(EngineOptions(model=str(model_dir), **options))
