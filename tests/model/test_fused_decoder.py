"""The fused decode step (nanoserve/model/layers/fused_decoder.py) against the module path it replaces.

Greedy ids must be the module path's token for token (the fused step runs the same kernels in the same
order, so it is exact, bf16 included) on every Llama- and Gemma-shaped family of tests/model/families.py
(the mixtures of experts included), in float32 and bfloat16, unquantized and int4, at batch 1 and in
batches, under chunked prefill and preemption and with prefix-cache hits; and on the bundled model. In
float32 both also match transformers (tests/model/test_families.py runs the engine, fused path included,
against it). A step that runs in one OpenMP region (quantized, bf16 or float32; float32 unquantized, on
dense_matmul) must give the kernel-after-kernel step's hidden states bit for bit, and a mixture of
experts' block the module's output bit for bit, for one token and for several.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import SHAPES, VOCAB, build_family
from gguf_files import write_gguf
from torch import nn

from nanoserve.core.engine_core import EngineCore
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.layers.fused_decoder import fusable_layers, fused_experts
from nanoserve.model.layers.linear import Linear, cpu_prepack_supported
from nanoserve.model.layers.moe import SparseMoE
from nanoserve.model.loader import load_model_config
from nanoserve.model.quant import GROUP_SIZE, fast_kernels, quantization_error
from tests.core.engine_steps import request, run_to_completion, tiny_engine

MOE_SHAPES = ("mixtral", "qwen2-moe", "qwen3-moe")
"""Their steps run kernel after kernel, never in one region: routing and grouping are ATen ops."""
FUSED_SHAPES = (
    "mistral-window",
    "qwen2-window",
    "qwen3-gqa-tied",
    "qwen3-mha-untied",
    "phi3-window-short",
    "phi3-longrope-long",
    "phi4-partial-rotary",
    "gemma2-gqa",
    "gemma2-mha-untied",
    "gemma3",
    *MOE_SHAPES,
)
"""Every shape of tests/model/families.py: the Llama (mixtures of experts and partial rotation included) and
the Gemma shapes."""
LENGTHS = (17, 40, 28, 21, 33, 19, 25, 18)
"""Longer than the windows and than LongRoPE's pretraining length (tests/model/families.py)."""


@pytest.fixture(scope="module", autouse=True)
def needs_kernels():
    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built on this machine")


@pytest.fixture(scope="module", params=FUSED_SHAPES)
def fused_dir(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=[s for s in FUSED_SHAPES if s not in MOE_SHAPES])
def region_dir(request, tmp_path_factory):
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


def needs_quant_matmul() -> None:
    """One-region steps and int8 run on quant_matmul only."""
    if not fast_kernels(cpu_kernels()):
        pytest.skip(quantization_error("int8", torch.device("cpu"), None) or "")


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, LENGTHS[i % len(LENGTHS)]).tolist() for i in range(num)]


def _greedy(engine: EngineCore, prompts: list[list[int]], prefix: str) -> tuple[list[list[int]], list[int]]:
    """Greedy ids and prompt tokens served from the prefix cache, per prompt."""
    for i, p in enumerate(prompts):
        engine.add_request(request(f"{prefix}{i}", p, max_tokens=12))
    results = run_to_completion(engine)
    return [results[f"{prefix}{i}"][0] for i in range(len(prompts))], [
        results[f"{prefix}{i}"][3] for i in range(len(prompts))
    ]


def _engine(model_dir, cpu_kernels: str, **options) -> EngineCore:
    engine = tiny_engine(model_dir, cpu_kernels=cpu_kernels, **options)
    model = engine.runner.model
    assert model is not None and (model.fused_decoder is not None) == (cpu_kernels == "auto")
    return engine


@pytest.mark.parametrize(
    "dtype, quantization",
    [("float32", "none"), ("float32", "int4"), ("bfloat16", "none"), ("bfloat16", "int4")],
)
def test_fused_decode_gives_the_module_paths_ids(fused_dir, dtype, quantization):
    prompts = _prompts(12, seed=2)
    followers = [p[:16] + [101, 102, 103] for p in prompts[:4]]
    # a window over every layer frees the blocks behind it: fewer blocks run out as soon
    blocks = 16 if load_model_config(str(fused_dir)).kv_window is None else 8
    results = {}
    for mode in ("auto", "unfused"):
        options = dict(dtype=dtype, quantization=quantization)
        # 7 tokens a step in too few blocks of 4: chunked prefill beside decodes, and preemption
        crowded = _engine(fused_dir, mode, max_num_batched_tokens=7, num_kv_blocks=blocks, **options)
        ids, _ = _greedy(crowded, prompts, "p")
        assert crowded.scheduler.num_preemptions > 0
        roomy = _engine(fused_dir, mode, **options)
        alone, _ = _greedy(roomy, prompts[:1], "one")  # batch 1
        _greedy(roomy, prompts[:4], "a")
        hits, cached = _greedy(roomy, followers, "f")
        assert cached == [16] * len(followers), "4 shared blocks from the prefix cache"
        results[mode] = (ids, alone, hits)
    assert results["auto"] == results["unfused"]


def test_every_family_shape_is_fused_and_other_layers_are_not():
    assert set(FUSED_SHAPES) == set(SHAPES)
    assert fusable_layers([nn.Linear(4, 4)]) is None


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_fused_decode_on_the_bundled_model(bundled_gguf_path, quantization):
    from nanoserve.config import EngineOptions

    if quantization == "int8":
        needs_quant_matmul()
    prompts = [list(range(100 + 7 * i, 120 + 9 * i)) for i in range(4)]
    ids = {}
    for mode in ("auto", "unfused"):
        options = EngineOptions(
            model=bundled_gguf_path,
            dtype="bfloat16",
            quantization=quantization,
            cpu_kernels=mode,
            num_kv_blocks=64,
        )
        engine = EngineCore(options)
        assert engine.runner.model is not None
        assert (engine.runner.model.fused_decoder is not None) == (mode == "auto")
        ids[mode] = _greedy(engine, prompts, "b")[0] + _greedy(engine, prompts[:1], "one")[0]
        engine.shutdown()
    assert ids["auto"] == ids["unfused"]
    assert torch.tensor(ids["auto"][0]).unique().numel() > 1, "a real continuation, not one repeated token"


class CountingDecoder:
    """A FusedDecoder that counts its calls."""

    def __init__(self, fused) -> None:
        self.fused, self.num_calls = fused, 0

    def forward(self, x, *args):
        self.num_calls += 1
        return self.fused.forward(x, *args)

    def prefill(self, *args):
        return self.fused.prefill(*args)


@pytest.mark.parametrize("shape", ["qwen3-gqa-tied", "mistral-window"])
def test_drafted_steps_stay_on_the_fused_decode_step(shape, tmp_path):
    model_dir = build_family(shape, tmp_path / shape)
    phrases = _prompts(4, seed=3)
    prompts = [(p[:5] * 8)[: 30 + 3 * i] for i, p in enumerate(phrases)]  # loops the lookup predicts
    plain, _ = _greedy(_engine(model_dir, "auto"), prompts, "p")
    engine = _engine(model_dir, "auto", speculative="ngram")
    model = engine.runner.model
    assert model is not None
    model.fused_decoder = counting = CountingDecoder(model.fused_decoder)
    execute, steps = engine.runner.execute, []

    def counted(scheduled):
        if all(c.num_known_tokens == 1 for c in scheduled.chunks):
            steps.append(sum(len(c.draft_token_ids) for c in scheduled.chunks))
        return execute(scheduled)

    engine.runner.execute = counted
    drafted, _ = _greedy(engine, prompts, "s")
    assert drafted == plain
    assert any(steps) and counting.num_calls == len(steps), "every decode step, drafted or not, is fused"
    assert engine.scheduler.get_stats().num_accepted_tokens > 0


UNEVEN_SPEEDS = (2.5, 0.4)
"""Thread speeds that cut the region's matmuls far from evenly (thread 0 takes 86 % with two threads)."""
MAX_BALANCED_THREADS = 64
"""Past this many threads the region cuts its matmuls evenly (ThreadSpeeds::MAX_THREADS)."""


class RegionCheckingDecoder:
    """A FusedDecoder that runs each step kernel after kernel, then in one region, and checks that the two
    give the same bits (both write the same K/V to the same slots). Every other region step cuts its matmuls
    by UNEVEN_SPEEDS instead of the speeds it has learned."""

    def __init__(self, fused) -> None:
        self.fused, self.region_steps, self.batch_sizes = fused, 0, set()

    def forward(self, x, *args):
        self.fused.one_region = False
        reference = self.fused.forward(x, *args)
        self.fused.one_region = True
        threads = torch.get_num_threads()
        if self.region_steps % 2 and threads <= MAX_BALANCED_THREADS:
            self.fused.thread_speeds = [UNEVEN_SPEEDS[t % 2] for t in range(threads)]
        before = self.fused.region_steps
        out = self.fused.forward(x, *args)
        assert torch.equal(out, reference), "the one-region step differs from kernel after kernel"
        ran = self.fused.region_steps == before + 1
        assert ran == self.fused.one_region_at(x.shape[0]), "the step's inputs kept it out of the region"
        if ran:
            self.region_steps += 1
            self.batch_sizes.add(x.shape[0])
        return out

    def prefill(self, *args):
        return self.fused.prefill(*args)


def _check_regions(engine: EngineCore, prompts: list[list[int]]) -> RegionCheckingDecoder:
    model = engine.runner.model
    assert model is not None and model.fused_decoder is not None
    model.fused_decoder = checking = RegionCheckingDecoder(model.fused_decoder)
    _greedy(engine, prompts[:1], "one")
    _greedy(engine, prompts, "many")
    return checking


@pytest.mark.parametrize(
    "dtype, quantization, kv_cache_dtype",
    [
        ("bfloat16", "int4", "auto"),
        ("float32", "int4", "auto"),
        ("float32", "none", "auto"),
        ("float32", "int4", "bfloat16"),
        ("float32", "none", "bfloat16"),
        ("bfloat16", "int4", "fp8_e5m2"),
        ("float32", "none", "fp8_e5m2"),
        ("bfloat16", "int4", "int8"),
        ("float32", "none", "int8"),
    ],
)
def test_one_region_step_gives_the_kernel_after_kernel_bits(region_dir, dtype, quantization, kv_cache_dtype):
    if quantization != "none":
        needs_quant_matmul()
    engine = _engine(
        region_dir, "auto", dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    checking = _check_regions(engine, _prompts(6, seed=4))
    assert checking.region_steps > 0 and {1, 6} <= checking.batch_sizes


@pytest.mark.parametrize(
    "dtype, quantization",
    [("bfloat16", "int4"), ("bfloat16", "int8"), ("float32", "int4"), ("float32", "none")],
)
def test_one_region_step_on_the_bundled_model(bundled_gguf_path, dtype, quantization):
    from nanoserve.config import EngineOptions

    if quantization != "none":
        needs_quant_matmul()
    options = EngineOptions(model=bundled_gguf_path, dtype=dtype, quantization=quantization, num_kv_blocks=64)
    engine = EngineCore(options)
    checking = _check_regions(engine, [list(range(100 + 7 * i, 120 + 9 * i)) for i in range(5)])
    engine.shutdown()
    assert checking.region_steps > 0 and {1, 5} <= checking.batch_sizes


def test_one_region_step_on_a_q8_0_file(tmp_path):
    """A Q8_0 file's symmetric codes are packed with their scales alone, and region steps run them."""
    needs_quant_matmul()
    folder = build_family("qwen3-gqa-tied", tmp_path / "hf")
    engine = _engine(write_gguf(folder, tmp_path / "model-Q8_0.gguf", "Q8_0"), "auto", quantization="auto")
    model = engine.runner.model
    assert model is not None
    weights = model.quantized_weights()
    assert weights and all(w.scales.numel() * GROUP_SIZE == w.codes.numel() for w in weights)
    checking = _check_regions(engine, _prompts(5, seed=6))
    assert checking.region_steps > 0 and {1, 5} <= checking.batch_sizes


def test_the_region_learns_each_threads_speed(bundled_gguf_path):
    """The region times each thread's share of its matmuls and cuts the next ones by the speeds it learns:
    one speed per thread, relative to their geometric mean."""
    from nanoserve.config import EngineOptions

    needs_quant_matmul()
    engine = EngineCore(EngineOptions(model=bundled_gguf_path, quantization="int4", num_kv_blocks=64))
    fused = engine.runner.model.fused_decoder
    assert fused.thread_speeds == []
    _greedy(engine, [list(range(100, 120))], "learn")
    engine.shutdown()
    speeds = fused.thread_speeds
    if not 1 < torch.get_num_threads() <= MAX_BALANCED_THREADS:
        assert speeds == []
        return
    assert len(speeds) == torch.get_num_threads() and all(0.1 < s < 10 for s in speeds)
    assert np.prod(speeds) == pytest.approx(1.0, rel=1e-6) and speeds != [1.0] * len(speeds)
    with pytest.raises(ValueError, match="speeds must be positive"):
        fused.thread_speeds = [1.0, 0.0]


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_experts_stay_kernel_after_kernel(shape, tmp_path):
    needs_quant_matmul()
    engine = _engine(build_family(shape, tmp_path / shape), "auto", dtype="float32", quantization="int4")
    model = engine.runner.model
    assert model is not None and not any(model.fused_decoder.one_region_at(n) for n in (1, 6, 32))


@pytest.mark.parametrize("shape", ["mixtral", "qwen2-moe"])
@pytest.mark.parametrize("dtype, quantization", [("bfloat16", "int4"), ("float32", "none")])
def test_fused_experts_give_the_moe_blocks_bits(shape, dtype, quantization, tmp_path):
    """One token (its experts one after the other) and several (grouped per expert), with and without
    renormalized weights and a shared expert."""
    if quantization != "none":
        needs_quant_matmul()
    engine = _engine(build_family(shape, tmp_path / shape), "auto", dtype=dtype, quantization=quantization)
    model = engine.runner.model
    assert model is not None
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert blocks
    torch.manual_seed(0)
    with torch.inference_mode():
        for moe in blocks:
            fused = fused_experts(cpu_kernels(), moe)
            for tokens in (1, 6):
                x = torch.randn(tokens, model.config.hidden_size).to(model.embed_tokens.weight.dtype)
                assert torch.equal(fused(x, moe.experts[0].activation), moe(x))


def test_unquantized_bf16_steps_stay_kernel_after_kernel(fused_dir):
    model = _engine(fused_dir, "auto", dtype="bfloat16").runner.model
    assert model is not None and not model.fused_decoder.one_region_at(1)


def test_fused_decode_refuses_ids_and_positions_it_has_no_rows_for(fused_dir):
    """The fused step looks up embeddings, rotary rows and cache slots itself: it raises where an index
    would run past a table, as torch's lookups do, instead of reading past it."""
    engine = _engine(fused_dir, "auto")
    model, caches = engine.runner.model, engine.runner.kv_caches
    assert model is not None
    table, ok_id, ok_len = torch.zeros((1, 4), dtype=torch.int32), torch.tensor([5]), torch.tensor([3])
    vocab = model.embed_tokens.weight.shape[0]
    with pytest.raises(RuntimeError, match=f"token id {vocab} out of range"):
        model.decode(torch.tensor([vocab]), caches, table, ok_len)
    with pytest.raises(RuntimeError, match="position 99 outside"):
        model.decode(ok_id, caches, table, torch.tensor([100]))  # beyond the 4 blocks of the table
    with pytest.raises(RuntimeError, match="no block for position 2"):
        model.decode(ok_id, caches, torch.full((1, 4), -1, dtype=torch.int32), ok_len)
    assert model.decode(ok_id, caches, table, ok_len).shape == (1, model.config.hidden_size)


@pytest.mark.parametrize(
    "dtype, quantization, by_rows",
    [
        ("float32", "none", False),
        ("bfloat16", "none", False),
        ("bfloat16", "int4", False),
        ("bfloat16", "none", True),
        ("bfloat16", "int4", True),
    ],
)
def test_fused_prefill_gives_the_module_paths_bits(fused_dir, dtype, quantization, by_rows):
    """Every step of prompts whose sequences the C++ prefill kernel attends runs fused; each is checked
    against the module path on the same inputs: whole prompts, prefix-cache hits and chunks after cached
    ones. by_rows: every step of more than 8 rows multiplies the packed weights by rows (Linear.split_from;
    int4 gives those steps up), in both."""
    if by_rows and not cpu_prepack_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN's bf16 packing is not available here: no weight is multiplied by rows")
    engine = _engine(fused_dir, "auto", dtype=dtype, quantization=quantization, max_num_batched_tokens=48)
    model = engine.runner.model
    assert model is not None
    split_calls = []
    if by_rows:
        kernels = cpu_kernels()
        assert kernels is not None
        for module in model.modules():
            if isinstance(module, Linear) and module.quantized is not None:
                if module.packed is None:  # dropped where the quantized copy served every step size
                    module.prepack()
                module.quantized.max_tokens = 8
            if isinstance(module, Linear) and module.packed is not None:
                module.split_from = 9
                module.by_rows = lambda *args: split_calls.append(1) or kernels.packed_linear_by_rows(*args)
        model.use_cpu_kernels(kernels)  # the fused decoder again, with the new step choices
    fused, module_path = model.fused_decoder, model.forward
    checked = {"steps": 0, "after_cached": 0}

    def checking_forward(input_ids, positions, kv_caches, attn):
        group = attn.prefill_on_kernel
        out = module_path(input_ids, positions, kv_caches, attn)
        if group is None:
            return out
        model.fused_decoder = None
        reference = module_path(input_ids, positions, kv_caches, attn)
        model.fused_decoder = fused
        assert torch.equal(out, reference), "the fused prefill differs from the module path"
        checked["steps"] += 1
        checked["after_cached"] += int(bool((group.seq_lens > group.query_lens).any()))
        return out

    model.forward = checking_forward
    prompts = _prompts(4, seed=5)
    _greedy(engine, prompts, "p")
    _greedy(engine, [p[:16] + [7, 8, 9] for p in prompts[:2]], "f")  # 16 tokens from the prefix cache
    _greedy(engine, [(_prompts(1, seed=6)[0] * 4)[:50]], "long")  # a chunk of 48, then one of 2
    assert checked["steps"] >= 3 and checked["after_cached"] >= 2
    assert bool(split_calls) == by_rows
