"""Quantized weights (--quantization int4 / int8): the kernels against dequantized weights, the per-step
choice between quantized and bf16 weights, and the quality cost on the bundled model (perplexity and
greedy agreement with bf16)."""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver
from quality import bf16_model, greedy, on_grid, perplexity, shared_prefix_lengths

from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.layers.linear import Linear
from nanoserve.model.quant import (
    GROUP_SIZE,
    LM_HEAD_QUANT_MAX_ROWS,
    fast_kernels,
    group_codes,
    pack_groups,
    pack_torch_int4,
    quantization_error,
    quantize_weight,
    symmetric_codes,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    """The C++ kernels when quant_matmul runs here, else None (quantization then uses torch's int4)."""
    module = cpu_kernels()
    return module if fast_kernels(module) else None


def needs_quant_matmul(kernels):
    if kernels is None:
        pytest.skip("the C++ quant_matmul (AVX-512 VNNI or AVX2) is not available here")


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as quant_matmul sees it: rounded to int8 steps per group of 32."""
    groups = x.float().view(x.shape[0], -1, GROUP_SIZE)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    return ((groups / scale).round() * scale).view(x.shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 6, 21, 135])  # 135: two chunks of 64 rows and a partial one
def test_quant_matmul_equals_quantized_reference(kernels, bits, rows):
    needs_quant_matmul(kernels)
    torch.manual_seed(bits * rows)
    # 21 tiles of 16 columns: a thread's share can be odd
    weight = on_grid(torch.randn(336, 576) * 0.05, bits)
    x = torch.randn(rows, 576)
    out = pack_groups(group_codes(weight, bits), kernels.quant_matmul).matmul(x)
    # exact on both grids (up to the float16 scales), and within int8 rounding of float activations
    torch.testing.assert_close(out, int8_activations(x) @ weight.T, atol=0.05, rtol=0.02)
    exact = x @ weight.T
    assert (out - exact).norm() < 0.01 * exact.norm()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("columns", [336, 12288])  # 12288: on 2 threads, each one's codes outgrow a 2 MiB L2
def test_quant_matmul_rows_come_out_the_same_in_any_batch(kernels, bits, columns):
    """A row's outputs do not depend on the rows beside it, bit for bit: a chunk's first rows and the rest
    go through different tile loops (one tile a pass, then two), with the same arithmetic per column; the
    chunks after the first start with two tiles where the codes stay in L2, with one where they do not."""
    needs_quant_matmul(kernels)
    torch.manual_seed(bits)
    packed = pack_groups(group_codes(torch.randn(columns, 576) * 0.05, bits), kernels.quant_matmul)
    x = torch.randn(135, 576, dtype=torch.bfloat16)
    together = packed.matmul(x)
    alone = torch.cat([packed.matmul(x[row : row + 1]) for row in range(x.shape[0])])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("rows", [1, 3, 6, 21])
def test_symmetric_8bit_codes_pack_with_the_scale_alone(kernels, rows):
    """Codes whose offset is -128 times the scale (Q8_0's) keep no offsets: 34 bytes a group, the same
    products as the dequantized weight."""
    needs_quant_matmul(kernels)
    torch.manual_seed(rows)
    weight = torch.randn(320, 576) * 0.05
    codes = symmetric_codes(weight)
    assert codes is not None
    packed = pack_groups(codes, kernels.quant_matmul)
    assert packed is not None and packed.nbytes == weight.numel() * 34 // 32
    x = torch.randn(rows, 576)
    reference = int8_activations(x) @ codes.dequantize().T
    torch.testing.assert_close(packed.matmul(x), reference, atol=1e-4, rtol=1e-4)


def test_symmetric_codes_give_q8_0_values_back():
    """A weight dequantized from Q8_0 (w = d * q, q in -127..127 reaching 127 in each group) gets its own
    codes and scales back, so the lm_head of a Q8_0 file is served with the file's values."""
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (64, 8, 32))
    q[..., 0] = 127 * torch.where(torch.rand(64, 8) < 0.5, 1, -1)
    d = (torch.rand(64, 8) * 0.01 + 1e-4).half()
    weight = (q * d.float().unsqueeze(-1)).view(64, 256)
    codes = symmetric_codes(weight)
    assert codes is not None
    assert torch.equal(codes.scale, d) and torch.equal(codes.codes.long() - 128, q)
    assert torch.equal(codes.dequantize(), weight)


def test_quant_matmul_refuses_4bit_codes_without_offsets(kernels):
    needs_quant_matmul(kernels)
    packed = pack_groups(group_codes(torch.randn(32, 64), 4), kernels.quant_matmul)
    assert packed is not None
    scale_only = packed.scales.view(2, 2, 2, 16)[:, :, :1].contiguous()
    with pytest.raises(RuntimeError, match="scales do not match codes"):
        kernels.quant_matmul(torch.randn(1, 64), packed.codes, scale_only, 4)


def test_torch_int4_reproduces_weights_on_its_grid():
    torch.manual_seed(0)
    weight = on_grid(torch.randn(96, 128) * 0.05, 4)
    for tokens in (1, 5, 16):
        x = torch.randn(tokens, 128)
        out = pack_torch_int4(group_codes(weight, 4)).matmul(x.bfloat16()).float()
        torch.testing.assert_close(out, x @ weight.T, atol=0.02, rtol=0.02)


def test_shapes_that_do_not_split_stay_unquantized(kernels):
    assert group_codes(torch.randn(16, 48), 4) is None  # K not in groups of 32
    assert quantize_weight(torch.randn(20, 64), 4, kernels) is None  # N not in tiles of 16


def test_int8_without_the_kernels_is_a_clear_error():
    assert "AVX-512 VNNI" in quantization_error("int8", CPU, None)
    assert quantization_error("int4", torch.device("cuda"), None).startswith("quantization 'int4' is for CPU")
    assert quantization_error("none", torch.device("cuda"), None) is None


def _step_logits(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one prefill step bigger than any quantized path takes, then of three decode steps."""
    driver = PagedDriver(model, prompts)
    driver.step({i: len(p) for i, p in enumerate(prompts)})
    prefill = torch.stack([rows[-1] for rows in driver.logits])
    for _ in range(3):
        driver.step({i: 1 for i in range(len(prompts))})
    return prefill, torch.stack([r for rows in driver.logits for r in rows[-3:]])


@pytest.mark.parametrize("backend", ["quant_matmul", "torch"])
@pytest.mark.parametrize("snap", [True, False], ids=["weights-on-int4-grid", "arbitrary-weights"])
def test_int4_steps_use_the_weights_their_kernel_serves(tiny_gqa_dir, kernels, snap, backend):
    if backend == "quant_matmul":
        needs_quant_matmul(kernels)
    else:
        kernels = None
    prompts = [list(range(5, 55)), list(range(100, 130))]  # an 80-token prefill: above torch's 16
    path = str(tiny_gqa_dir)
    bf16_prefill, bf16_decode = _step_logits(bf16_model(path, "none", kernels, snap), prompts)
    int4_prefill, int4_decode = _step_logits(bf16_model(path, "int4", kernels, snap), prompts)
    prefill_quantized = backend == "quant_matmul"
    for bf16, int4, quantized in (
        (bf16_prefill, int4_prefill, prefill_quantized),
        (bf16_decode, int4_decode, True),
    ):
        error, scale = (int4 - bf16).abs().max().item(), bf16.abs().max().item()
        if not quantized:
            assert error == 0  # the bf16 weights
        elif snap:
            assert error < 0.03 * scale  # the same weights: rounding of scales and activations only
        else:
            assert error > 0.03 * scale  # 4-bit weights really used


QUALITY_TEXT = (
    "The river rose through the night, and by morning the lower fields were under water. Farmers moved "
    "their animals to the hill behind the church, where the ground stayed dry. The mayor opened the "
    "school as a shelter, and volunteers brought blankets, bread and hot soup. When the rain stopped "
    "two days later, people began to clean the mud from their houses. Engineers came to inspect the "
    "old bridge, which had lost part of its railing but still stood. Within a month the market was "
    "open again, and children were back in their classrooms.\n\n"
    "A good loaf of bread needs only flour, water, salt and yeast, but it also needs time. Mix the flour "
    "and water first and let them rest for half an hour, so the flour can absorb the water. Then add the "
    "salt and the yeast and knead the dough until it is smooth and springs back when you press it. Cover "
    "the bowl and leave it in a warm place until the dough has doubled in size. Shape it gently, let it "
    "rise once more, and bake it in a hot oven until the crust is deep brown and the loaf sounds hollow "
    "when you tap the bottom.\n\n"
    "Computers store numbers in binary, using only the digits zero and one. Each digit is called a bit, "
    "and eight bits make a byte. A byte can hold any whole number from zero to two hundred and "
    "fifty-five. To store larger numbers, computers use several bytes together. Fractions are stored in "
    "a different way, as a sign, a set of significant digits and an exponent, which lets the same "
    "number of bits describe both very large and very small values, at the cost of some precision."
)
PERPLEXITY_BOUND = {"int4": 1.03, "int8": 1.01}
"""How much each method may raise the bundled model's perplexity on QUALITY_TEXT (about 420 tokens; on
a 110-token text, changes as small as the order of a rounding moved it by 1%). Measured with the C++
kernel: int4 1.008x, int8 1.003x."""


@pytest.fixture(scope="module")
def bf16_perplexity(bundled_gguf_path):
    from nanoserve.model_files import load_tokenizer

    token_ids = load_tokenizer(bundled_gguf_path).encode(QUALITY_TEXT)
    return token_ids, perplexity(bf16_model(bundled_gguf_path, "none", None), token_ids)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_perplexity_on_bundled_model(bundled_gguf_path, bf16_perplexity, kernels, method):
    if quantization_error(method, CPU, kernels):
        pytest.skip(quantization_error(method, CPU, kernels))
    token_ids, bf16 = bf16_perplexity
    quantized = perplexity(bf16_model(bundled_gguf_path, method, kernels), token_ids)
    print(f"perplexity bf16 {bf16:.3f}, {method} {quantized:.3f} ({quantized / bf16:.4f}x)")
    assert quantized < PERPLEXITY_BOUND[method] * bf16


AGREEMENT_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue.",
    "List three fruits:",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
    "Water boils at",
]
MIN_MEAN_AGREEMENT = 12
"""Greedy tokens (of 32) that a quantized model must share with bf16 before diverging, averaged over
AGREEMENT_PROMPTS. Measured with the C++ kernel: int4 17.3, int8 23.9 (greedy paths split at the first
near-tie, so a sound model still diverges early on a few prompts; a broken one at once on all)."""


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_greedy_agreement_with_bf16(bundled_gguf_path, kernels, method):
    if quantization_error(method, CPU, kernels):
        pytest.skip(quantization_error(method, CPU, kernels))
    from nanoserve.model_files import load_tokenizer

    tokenizer = load_tokenizer(bundled_gguf_path)
    prompts = [tokenizer.encode(p) for p in AGREEMENT_PROMPTS]
    reference = greedy(bf16_model(bundled_gguf_path, "none", None), prompts, 32)
    quantized = greedy(bf16_model(bundled_gguf_path, method, kernels), prompts, 32)
    shared = shared_prefix_lengths(quantized, reference)
    print(f"{method}: greedy tokens shared with bf16 per prompt {shared}")
    assert sum(shared) / len(shared) >= MIN_MEAN_AGREEMENT


def test_weight_bytes_per_step_count_the_copy_each_step_size_reads(tiny_gqa_dir, kernels):
    needs_quant_matmul(kernels)
    path = str(tiny_gqa_dir)
    bf16, int4 = bf16_model(path, "none", kernels), bf16_model(path, "int4", kernels)
    linears = [m for m in int4.layers.modules() if isinstance(m, Linear)]
    row = bf16.embed_tokens.weight[0].nbytes
    matrices = sum(m.weight.nbytes for m in linears) + bf16.lm_head_weight.nbytes
    assert bf16.weight_bytes_per_step(3, 3) == 3 * row + matrices
    codes = sum(m.quantized.codes.nbytes + m.quantized.scales.nbytes for m in linears)
    head = int4.quantized_lm_head
    assert int4.weight_bytes_per_step(1, 1) == row + codes + head.codes.nbytes + head.scales.nbytes
    for linear in linears:
        linear.quantized.max_tokens = 2  # steps past the limits read the bf16 weights
    past = LM_HEAD_QUANT_MAX_ROWS + 1
    assert int4.weight_bytes_per_step(past, past) == bf16.weight_bytes_per_step(past, past)


def test_quantized_weights_share_one_buffer_and_compute_the_same(tiny_gqa_dir, kernels):
    path = str(tiny_gqa_dir)
    model = bf16_model(path, "int4", kernels)
    weights = model.quantized_weights()
    buffers = {
        t.untyped_storage().data_ptr()
        for w in weights
        for t in vars(w).values()
        if isinstance(t, torch.Tensor)
    }
    assert len(weights) > 2 and len(buffers) == 1
    # the same codes as a fresh quantization of the same weight, in their own tensors
    layer = next(m for m in model.layers.modules() if isinstance(m, Linear) and m.quantized is not None)
    fresh = quantize_weight(layer.weight, 4, kernels)
    assert fresh is not None
    x = torch.randn(5, layer.weight.shape[1]).bfloat16()
    assert torch.equal(layer.quantized.matmul(x), fresh.matmul(x))
