"""Every model family against transformers on tiny random-weight models, fp32.

Per shape (tests/model/families.py): the paged forward's logits over a scheduled batch (PyTorch ops), and
the engine core's greedy ids token for token (C++ kernels where they build) under chunked prefill, a KV
budget that forces preemption, and prefix-cache hits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import SHAPES, VOCAB, build_family, prompt_lengths
from paged_driver import PagedDriver

from nanoserve.core.engine_core import EngineCore
from nanoserve.model.loader import load_model, load_model_config
from nanoserve.model_files import resolve_model_path
from tests.core.engine_steps import hf_greedy, request, run_to_completion, tiny_engine

CPU = torch.device("cpu")


@pytest.fixture(scope="session", params=sorted(SHAPES))
def family_dir(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


def _shape(family_dir) -> str:
    return family_dir.name.rstrip("0123456789")


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    # eager: transformers' reference attention (its SDPA path drops Gemma 2's soft-capping)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def test_config_reads_the_family(family_dir):
    config = load_model_config(resolve_model_path(str(family_dir)))
    hf = _hf_model(family_dir).config
    assert config.architecture == hf.architectures[0]
    assert config.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    windows = [
        hf.sliding_window if t == "sliding_attention" else None
        for t in getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    ]
    if getattr(hf, "sliding_window", None) is None:
        windows = [None] * hf.num_hidden_layers
    assert list(config.sliding_windows) == windows


def test_paged_forward_matches_transformers(family_dir):
    """Prefill in chunks beside decodes, then decodes, blocks in shuffled order: every logit row."""
    path = str(family_dir)
    ours = load_model(path, load_model_config(path), torch.float32, CPU)
    lengths = prompt_lengths(_shape(family_dir))[:4]
    driver = PagedDriver(ours, _prompts(lengths), num_blocks=96)
    driver.step({0: lengths[0], 1: 7})  # all of prompt 0, the first chunk of prompt 1
    driver.step({0: 1, 1: lengths[1] - 7, 2: lengths[2], 3: lengths[3]})
    for _ in range(4):
        driver.step({i: 1 for i in range(len(lengths))})
    driver.check_against(_hf_model(path))


def _run(engine: EngineCore, prompts: list[list[int]], prefix: str) -> tuple[list[list[int]], list[int], int]:
    """(greedy ids, prompt tokens served from the prefix cache, preemptions) per prompt."""
    for i, p in enumerate(prompts):
        engine.add_request(request(f"{prefix}{i}", p))
    before = engine.scheduler.num_preemptions
    results = run_to_completion(engine)
    ids = [results[f"{prefix}{i}"] for i in range(len(prompts))]
    return [r[0] for r in ids], [r[3] for r in ids], engine.scheduler.num_preemptions - before


def test_engine_greedy_matches_transformers(family_dir):
    """Eight prompts (twelve where windows free blocks) at 7 tokens a step (chunked prefill) in 16 blocks of
    4 tokens, too few for them (preemption); then, on a roomy engine, prompts that share the leading blocks
    of earlier ones (prefix-cache hits)."""
    lengths = prompt_lengths(_shape(family_dir))
    # a window over every layer frees blocks behind it, so it takes more requests to run out
    windowed = load_model_config(str(family_dir)).kv_window is not None
    prompts = _prompts(lengths + (lengths if windowed else lengths[1:3]), seed=1)
    followers = [p[:16] + [101, 102, 103] for p in prompts[:6] if len(p) >= 16]
    expected = hf_greedy(family_dir, prompts + followers)

    tokens, _, preemptions = _run(
        tiny_engine(family_dir, max_num_batched_tokens=7, num_kv_blocks=16), prompts, "p"
    )
    assert tokens == expected[: len(prompts)]
    assert preemptions > 0

    engine = tiny_engine(family_dir)
    assert _run(engine, prompts[:6], "a")[0] == expected[:6]
    tokens, cached, _ = _run(engine, followers, "f")
    assert tokens == expected[len(prompts) :]
    assert cached == [16] * len(followers), "4 shared blocks from the prefix cache"


@pytest.mark.parametrize("shape", ["gemma2-gqa", "qwen2-moe"])
def test_multiprocess_data_parallel_engines_serve_a_family(shape, tmp_path, tokenizer_dir):
    """LLM with two engine-core processes behind the data-parallel balancer: transformers' greedy ids.
    (The bundled tokenizer is larger than these models' vocabularies; prompts are token ids below it.)"""
    import shutil

    from nanoserve.entrypoints.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    folder = build_family(shape, tmp_path / shape)
    for f in tokenizer_dir.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, folder / f.name)
    prompts = _prompts((5, 19, 11, 27), seed=4)
    expected = hf_greedy(folder, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=len(expected[0]), ignore_eos=True)
    with LLM(str(folder), dtype="float32", data_parallel_size=2, num_kv_blocks=64, max_model_len=128) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.engine_core.balancer.num_routed.keys() == {0, 1}
    assert [o.outputs[0].token_ids for o in outputs] == expected
