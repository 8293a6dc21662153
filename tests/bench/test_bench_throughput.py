"""`nanoserve bench throughput` at toy sizes: greedy and sampled columns per engine, and their ratios."""

from __future__ import annotations

import re

import pytest

from nanoserve.bench import throughput


@pytest.mark.timeout(300)
def test_throughput_table_has_a_sampled_column_and_ratio_per_engine(capsys):
    throughput.main(["--engines", "inproc", "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "greedy and sampled (temperature 0.8, top_p 0.95)" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("batch"))
    assert "nanoserve (inproc) sampled" in header and "inproc sampled/greedy" in header
    row = next(line for line in out.splitlines() if line.lstrip().startswith("2 "))
    assert re.fullmatch(r"\s*2(\s+[\d.]+ \(\d+-\d+\)){2}\s+\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", row), row


def test_a_ratio_compares_each_repeat_with_itself():
    """The machine slows fourfold in the second repeat: the top column is ahead in two repeats of three,
    which the ratio says, where the medians' ratio (300 / 400) would say 0.75x."""
    assert throughput.paired_ratio([600.0, 150.0, 300.0], [500.0, 125.0, 400.0]) == "1.20x (0.75-1.20)"
    assert throughput.paired_ratio([3.0, 1.0, 2.0], [2.0, 2.0, 2.0]) == "1.00x (0.50-1.50)"
    with pytest.raises(ValueError):
        throughput.paired_ratio([1.0], [1.0, 2.0])


def test_engine_names_spell_their_options():
    assert throughput.nanoserve_options("inproc-int4-kvbf16") == {
        "multiprocess_mode": False,
        "quantization": "int4",
        "cpu_kernels": "auto",
        "kv_cache_dtype": "bfloat16",
    }
    assert throughput.nanoserve_options("mp-nokernels")["kv_cache_dtype"] == "auto"
    assert throughput.nanoserve_options("mp-int4-kvfp8")["kv_cache_dtype"] == "fp8_e5m2"
    assert throughput.nanoserve_options("inproc-kvint8")["kv_cache_dtype"] == "int8"
    for name in ("mp-kvfp16", "gpu", "mp-int4-int8", "mp-nokernels-unfused", "mp-kvbf16-kvfp8"):
        with pytest.raises(ValueError, match="unknown engine"):
            throughput.nanoserve_options(name)


def test_no_timed_run_finds_its_prompts_in_the_prefix_cache(tiny_gqa_dir):
    """Windows of one passage, cached by the run before, would let a run skip its prompts' prefill (and an
    engine whose cache holds them all look faster than one whose cache cannot)."""
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(str(tiny_gqa_dir), multiprocess_mode=False) as llm:
        tokenizer = llm.get_tokenizer()

        def cached_tokens(prompts: list[list[int]]) -> int:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(o.num_cached_tokens for o in outputs)

        same = throughput.make_prompts(tokenizer, 4, 64)
        assert cached_tokens(same) == 0 and cached_tokens(same) > 0  # what fresh prompts avoid
        fresh = throughput.FreshPrompts(tokenizer, 64)
        for batch in (4, 2, 4, 1, 4):  # a batch size again after others: still nothing to reuse
            prompts = fresh(batch)
            assert [len(p) for p in prompts] == [64] * batch
            assert cached_tokens(prompts) == 0
