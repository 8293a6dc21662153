"""The C++ decode- and prefill-attention kernels against attention written out in PyTorch, on a scattered
paged cache; the logits' soft-capping against torch's tanh; the MLP's activations against torch's.

The model tests run the kernel through tiny models (head size 16); these cover the head sizes compiled
as constants (64 is the bundled model's), contexts of many blocks whose scores grow along the context
(so the running softmax must rescale), a block table wider than any context, and contexts split into
parts when there are fewer tasks than threads.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F


def _reference(q, kv_cache, block_table, seq_lens, window=0, softcap=0.0):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    out = []
    for seq in range(num_seqs):
        context = int(seq_lens[seq])
        first = max(0, context - window) if window else 0
        blocks = block_table[seq, : math.ceil(context / block_size)].long()
        k, v = (
            kv_cache[i][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, first:context].float()
            for i in (0, 1)
        )
        per_kv = num_heads // num_kv_heads
        k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
        scores = q[seq].float().unsqueeze(1) @ k.transpose(1, 2) / math.sqrt(head_dim)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append((torch.softmax(scores, -1) @ v).reshape(-1))
    return torch.stack(out)


CASES = {
    "batch": (6, 2, [1, 16, 17, 95, 300]),
    # fewer (sequence, KV head) tasks than threads can share: long contexts split into parts, the short
    # sequence's second part empty
    "few-tasks": (4, 1, [1000, 20]),
    # batch 1 of SmolLM2's heads: 3 tasks on 2 threads, a short context split in two
    "one-sequence": (9, 3, [96]),
    # 7 query heads a KV head (Qwen2.5-0.5B): on AVX-512 their V sums in two groups, of 4 heads and of 3
    "wide-groups": (14, 2, [33, 200]),
}


@pytest.mark.parametrize("case", CASES)
# 80: V sums in a pass of 64 columns and one of 16, q.k without bf16 pairs; 96: passes of 64 and 32
@pytest.mark.parametrize("head_dim", [64, 128, 24, 80, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference(kernels, two_threads, head_dim, dtype, case):
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, lengths = CASES[case]
    block_size, num_blocks = 16, 160
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim)
    # keys that line up with the query more and more along the context: the max moves block by block
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    ramp = torch.linspace(0, 3, num_blocks * block_size).view(num_blocks, block_size, 1)
    kv_cache[0] += ramp * q[:, :num_kv_heads].mean(0).view(num_kv_heads, 1, 1, head_dim)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    block_table = torch.stack([torch.randperm(num_blocks)[:64] for _ in seq_lens]).int()

    out = kernels.paged_decode_attention(q, kv_cache, block_table, seq_lens, 1 / math.sqrt(head_dim), 0, 0.0)

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.float(), _reference(q, kv_cache, block_table, seq_lens), atol=tolerance, rtol=0
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "window, softcap", [(40, 0.0), (0, 2.0), (300, 2.0)], ids=["window", "softcap", "both"]
)
def test_decode_attention_window_and_softcap(kernels, two_threads, case, window, softcap):
    """A window starts the walk inside a block, and blocks behind it are never read: they hold NaN here,
    as a freed and reused block may hold anything."""
    torch.manual_seed(window)
    num_heads, num_kv_heads, lengths = CASES[case]
    block_size, num_blocks, head_dim = 16, 160, 64
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim) * 2
    q = torch.randn(len(seq_lens), num_heads, head_dim)
    block_table = torch.stack([torch.randperm(num_blocks - 1)[:64] for _ in seq_lens]).int()
    reference = _reference(q, kv_cache, block_table, seq_lens, window, softcap)
    kv_cache[:, :, num_blocks - 1] = float("nan")
    for seq, length in enumerate(lengths):
        first = max(0, length - window) if window else 0
        block_table[seq, : first // block_size] = num_blocks - 1
    out = kernels.paged_decode_attention(
        q, kv_cache, block_table, seq_lens, 1 / math.sqrt(head_dim), window, softcap
    )
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cap", [30.0, 5.0])
@pytest.mark.parametrize("shape", [(32, 4096), (3, 1001), (1, 7)])
def test_soft_cap_logits_matches_torch(kernels, two_threads, shape, cap):
    """In place, to float precision, on both sides of |x| / cap = 0.625 (where the kernel's tanh changes
    formula), deep into saturation, at infinities, over a tail of fewer than 16 values; a NaN stays NaN."""
    torch.manual_seed(0)
    logits = torch.randn(shape) * 2 * cap
    edges = torch.tensor([0.0, 1e-6, -0.6249, 0.6251, 40.0, float("inf"), float("-inf"), float("nan")]) * cap
    logits.view(-1)[: min(len(edges), logits.numel())] = edges[: logits.numel()]
    reference = (torch.tanh(logits.double() / cap) * cap).float()
    out = kernels.soft_cap_logits(logits, cap)
    assert out.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(out, reference, atol=4e-7 * cap, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 2 * 1536), (9, 2 * 40), (1, 2 * 7)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_activation_and_mul_matches_torch(kernels, two_threads, activation, shape, dtype):
    """act(gate) * up over [T, 2 I] rows against float64: a few float32 steps off (and gelu's cancellation
    near 0), so a bf16 result is at most one of its own steps off after rounding; over whole lanes and a
    tail of fewer than 16. Gates far below -88 (e^-g past float's range) give -0, not NaN."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype)
    x[0, :4] = torch.tensor([0.0, 90.0, -90.0, -1e-6])
    gate, up = x.double().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    reference = (act * up).to(dtype)
    out = getattr(kernels, f"{activation}_and_mul")(x)
    assert out.dtype == dtype and out.shape == (shape[0], shape[1] // 2)
    assert torch.isfinite(out).all()
    steps = 2 if dtype == torch.bfloat16 else 8
    cancelled = 4 * torch.finfo(torch.float32).eps * (gate * up).abs()  # gelu's 1 + tanh near -1, in float32
    tolerance = steps * torch.finfo(dtype).eps * reference.double().abs() + cancelled + 1e-30
    assert ((out.double() - reference.double()).abs() <= tolerance).all()


def test_builds_are_kept_apart_per_cpu():
    """-march=native code built on one CPU must not be loaded on another sharing the home folder."""
    from nanoserve.model.kernels import cpu_identity, library_name

    here = cpu_identity()
    assert here.strip()
    assert library_name(here) == library_name(here)
    assert library_name(here) != library_name(here + " amx_tile")
    assert library_name(here) != library_name("x86_64 Another CPU fpu sse2 avx2")


def test_a_named_target_builds_apart_from_native(monkeypatch):
    """NANOSERVE_KERNEL_ARCH (tests/other_cpus.py) compiles for that target, into a build of its own."""
    from nanoserve import envs
    from nanoserve.model.kernels import build_flags, cpu_identity, library_name

    monkeypatch.delenv(envs.KERNEL_ARCH, raising=False)
    assert "-march=native" in build_flags()
    native = library_name(cpu_identity())
    monkeypatch.setenv(envs.KERNEL_ARCH, "x86-64-v3")
    assert "-march=x86-64-v3" in build_flags() and "-march=native" not in build_flags()
    assert library_name(cpu_identity()) != native


def test_a_new_build_removes_all_but_the_most_recently_used(monkeypatch, tmp_path):
    """Every source change makes a new build: the cache keeps the KEPT_BUILDS last loaded, and the new one."""
    import os

    from nanoserve import envs
    from nanoserve.model import kernels as kernel_builds

    monkeypatch.setenv(envs.KERNEL_DIR, str(tmp_path))
    builds = [tmp_path / f"{kernel_builds.PREFIX}{i:02d}" for i in range(12)]
    for age, folder in enumerate(builds):
        folder.mkdir()
        os.utime(folder, (1e9 - age, 1e9 - age))  # builds[0] the most recently used
    kernel_builds.mark_used(builds[11])  # loaded now: the most recent of all
    (tmp_path / "matmul_choice.json").write_text("{}")
    new = tmp_path / f"{kernel_builds.PREFIX}new"
    new.mkdir()
    os.utime(new, (0, 0))
    kernel_builds.prune_builds(keep=new)
    kept = sorted(p.name for p in tmp_path.iterdir())
    expected = [builds[11], *builds[: kernel_builds.KEPT_BUILDS - 2], new]
    assert kept == sorted([p.name for p in expected] + ["matmul_choice.json"])


def _prefill_reference(q, kv_cache, block_table, query_lens, seq_lens, scale, window, softcap):
    """Each sequence's queries sit at the last query_len positions of its context."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    per_kv = num_heads // num_kv_heads
    out, row = [], 0
    for seq, (query_len, context) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = block_table[seq, : math.ceil(context / block_size)].long()
        k, v = (
            kv_cache[i][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :context].float() for i in (0, 1)
        )
        k, v = k.repeat_interleave(per_kv, 0), v.repeat_interleave(per_kv, 0)
        queries = q[row : row + query_len].float().transpose(0, 1)  # [heads, query_len, head_dim]
        scores = queries @ k.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        positions = torch.arange(context - query_len, context)[:, None]
        keys = torch.arange(context)[None, :]
        visible = keys <= positions
        if window:
            visible &= keys > positions - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out.append((probs @ v).transpose(0, 1).reshape(query_len, -1))
        row += query_len
    return torch.cat(out)


PREFILL_CASES = {
    # (num_heads, num_kv_heads, [(query_len, seq_len)]): whole prompts, chunks of longer ones (queries
    # after a cached context), a tile's worth and a fraction of one, a single query among prefills
    "gqa": (9, 3, [(37, 37), (5, 50), (16, 16), (1, 9), (70, 200)]),
    "mha": (4, 4, [(300, 300), (17, 40)]),
}


@pytest.mark.parametrize("case", PREFILL_CASES)
# 32 to 256: a row per lane with AVX512-BF16 (each size its own number of rows weighed at once); 80: a key
# per lane in bf16 pairs (a row per lane takes multiples of 32); 24: no fixed size
@pytest.mark.parametrize("head_dim", [64, 128, 24, 80, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "window, softcap", [(0, 0.0), (40, 0.0), (0, 2.0), (7, 3.0)], ids=["plain", "window", "softcap", "both"]
)
def test_prefill_attention_matches_reference(kernels, two_threads, case, head_dim, dtype, window, softcap):
    """Blocks wholly behind every query's window hold NaN, as a freed and reused block may: they must
    never be read."""
    torch.manual_seed(head_dim + window)
    num_heads, num_kv_heads, shapes = PREFILL_CASES[case]
    query_lens = [query_len for query_len, _ in shapes]
    seq_lens = [context for _, context in shapes]
    block_size, num_blocks = 16, 160
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim) * 2
    # q of the step's tokens, sequence after sequence, with two more rows (other requests' tokens)
    q = torch.randn(sum(query_lens) + 2, num_heads, head_dim)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    block_table = torch.stack([torch.randperm(num_blocks - 1)[:24] for _ in shapes]).int()
    scale = 1.5 / math.sqrt(head_dim)
    reference = _prefill_reference(q, kv_cache, block_table, query_lens, seq_lens, scale, window, softcap)
    if window:
        kv_cache[:, :, num_blocks - 1] = float("nan")
        for seq, (query_len, context) in enumerate(shapes):
            first = max(0, context - query_len - window + 1)
            block_table[seq, : first // block_size] = num_blocks - 1
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)

    out = kernels.paged_prefill_attention(
        q,
        kv_cache,
        block_table,
        starts,
        torch.tensor(query_lens),
        torch.tensor(seq_lens),
        scale,
        window,
        softcap,
    )

    # bfloat16 outputs are rounded to 8 bits of mantissa: the values here reach 8
    tolerance = dict(atol=1e-4, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), reference, **tolerance)


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 300])
def test_prefill_attention_over_long_contexts(kernels, two_threads, head_dim, dtype, window):
    """Contexts longer than a block of keys (128 with a row per lane): the running softmax carries across
    blocks, an odd number of key chunks ends a block, a tile's first rows see none of the keys of its
    last block (they sit past those rows' positions), and a long window starts inside a block."""
    torch.manual_seed(window + head_dim)
    shapes = [(290, 600), (1, 530), (40, 300), (3, 3)]
    query_lens = [query_len for query_len, _ in shapes]
    seq_lens = [context for _, context in shapes]
    block_size, num_heads, num_kv_heads = 16, 6, 2
    blocks_per_seq = math.ceil(max(seq_lens) / block_size)
    num_blocks = blocks_per_seq * len(shapes)
    kv_cache = (torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim) * 2).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    block_table = torch.randperm(num_blocks).int().view(len(shapes), blocks_per_seq)
    scale = 1.5 / math.sqrt(head_dim)
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)

    out = kernels.paged_prefill_attention(
        q, kv_cache, block_table, starts, torch.tensor(query_lens), torch.tensor(seq_lens), scale, window, 0.0
    )

    reference = _prefill_reference(q, kv_cache, block_table, query_lens, seq_lens, scale, window, 0.0)
    tolerance = dict(atol=1e-4, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), reference, **tolerance)
