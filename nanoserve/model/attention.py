"""Paged attention in plain PyTorch: a per-layer KV cache of blocks, gathered per request each step.

Cache layout per layer: [2 (k, v), num_kv_heads, num_blocks, block_size, head_dim]. Gathering a
request's blocks along dim 2 yields [2, num_kv_heads, num_seqs, context, head_dim] contiguous, which
is exactly the batched-matmul layout attention wants, so the gather is the only copy of the context.

Requests are split into at most two groups per step, each one attention call per layer:
- decode (query length 1): batched matmuls with the query heads that share a KV head stacked as rows,
  so K/V are never repeated for GQA;
- prefill (longer queries, chunked or not): with the C++ kernels, a causal flash-style kernel that reads
  K/V in place and skips the keys after each query, or torch's causal flash attention for prompts
  attended whole where the engine measured it faster (nanoserve.model.flash_prefill); otherwise queries
  padded to [num_seqs, max_query_len] and one `scaled_dot_product_attention` call with a causal mask.
Splitting keeps a long prefill from padding every decode in the batch to its length. A short query
(a decode with its speculative drafts, up to `max_decode_query_len` tokens) joins the decode group as
one row per token, each a sequence that ends at its own position: that is the causal mask, and it keeps
a verification step on the decode kernels (and the fused decode step) rather than on prefill attention.

Per layer, attention may be limited to a sliding window (the keys within `window` positions of the
query, itself included), its scores soft-capped (cap * tanh(score / cap)) and its queries scaled by a
factor of the family's; the masks of each window are built once per step and shared by the layers that
use it. Block-table entries of blocks freed behind every layer's window (NULL_BLOCK) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.model.batch import NULL_BLOCK
from nanoserve.model.flash_prefill import PrefillSplit, WholePrompt, attend_split
from nanoserve.model.huge_pages import HugePageBuffer, huge_page_zeros
from nanoserve.model.kv_rows import as_copyable, decode, encode, row_width


@dataclass
class AttentionGroup:
    """Requests that share one attention call."""

    num_seqs: int
    max_query_len: int
    block_index: torch.Tensor
    """[num_seqs * num_ctx_blocks] block ids, request after request; padding points at a real block."""
    context_len: int
    """num_ctx_blocks * block_size: the padded context each request attends over."""
    query_positions: np.ndarray
    """[num_seqs, max_query_len] position of each query (padded rows repeat the last real one)."""
    token_index: torch.Tensor | None
    """[num_seqs * max_query_len] flat token row for each padded query slot; None: the tokens are the
    whole batch, already in padded order."""
    out_rows: torch.Tensor | None
    """[group tokens] rows of the padded output holding real tokens; None: every row is real."""
    out_index: torch.Tensor | None
    """[group tokens] flat token rows those outputs go to; None: the whole batch, in order."""
    block_table: torch.Tensor
    """int32 [num_seqs, num_ctx_blocks], for the decode kernel."""
    seq_lens: torch.Tensor
    """int64 [num_seqs], for the decode and prefill kernels."""
    query_starts: torch.Tensor
    """int64 [num_seqs] flat token row of each request's first query, for the prefill kernel."""
    query_lens: torch.Tensor
    """int64 [num_seqs] each request's real queries, for the prefill kernel."""
    device: torch.device
    split: PrefillSplit | None = None
    """Set where some sequence is a prompt long enough for torch's flash attention to beat the
    prefill kernel (nanoserve.model.flash_prefill); the others go to the kernel."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def visible(self, window: int | None) -> torch.Tensor:
        """bool [num_seqs, max_query_len, context_len]: which keys each query attends to."""

        def build() -> torch.Tensor:
            keys = np.arange(self.context_len)[None, None, :]
            last = self.query_positions[:, :, None]
            visible = keys <= last
            if window is not None:
                visible &= keys > last - window
            return _to_device(visible, self.device)

        return self.cached(("visible", window), build)

    def cached(self, key, build):
        """Per-step values derived once (by the first layer) and shared by the others."""
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = build()
        return value


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    num_tokens: int
    slot_mapping: torch.Tensor
    """[num_tokens] cache slot (block * block_size + offset) each new token's K/V is written to."""
    groups: list[AttentionGroup]
    kernels: ModuleType | None = None
    """The C++ CPU kernels (nanoserve.model.kernels): rotary embedding with the cache write, and decode
    attention reading K/V in place; None: PyTorch ops (index_copy_, gather + bmm)."""

    @property
    def decode_only(self) -> AttentionGroup | None:
        """The one group of a step where every sequence decodes one token, in batch order; else None."""
        if len(self.groups) == 1 and self.groups[0].is_decode and self.groups[0].out_index is None:
            return self.groups[0]
        return None

    @property
    def prefill_on_kernel(self) -> AttentionGroup | None:
        """The one group of a step of prompts (or chunks), every sequence attended by the C++ prefill
        kernel (none goes to torch's flash attention), in batch order; else None."""
        if self.kernels is None or len(self.groups) != 1:
            return None
        group = self.groups[0]
        return None if group.is_decode or group.split is not None else group


def build_attention_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
    kernels: ModuleType | None = None,
    max_decode_query_len: int = 1,
    flash_min_query_len: int | None = None,
) -> AttentionMetadata:
    """max_decode_query_len: queries up to this long are attended as decode rows, one per token;
    flash_min_query_len: prefills whose context is at least this long, with no more cached tokens than new
    ones, go to torch's flash attention."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    # blocks freed behind a sliding window are masked out; any valid id will do for the gather
    block_table = np.asarray(block_table, dtype=np.int64)
    block_table = np.where(block_table == NULL_BLOCK, 0, block_table)
    num_seqs = len(query_lens)
    num_tokens = int(query_lens.sum())
    token_starts = np.cumsum(query_lens) - query_lens  # first flat row of each request

    # absolute position and owning request of every new token
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = (
        seq_lens[seq_of_token]
        - query_lens[seq_of_token]
        + (np.arange(num_tokens) - token_starts[seq_of_token])
    )
    slots = block_table[seq_of_token, positions // block_size] * block_size + positions % block_size

    if max_decode_query_len > 1 and bool((query_lens > 1).any()):
        query_lens, seq_lens, token_starts, block_table = _split_short_queries(
            query_lens, seq_lens, token_starts, block_table, max_decode_query_len
        )
    is_decode = query_lens == 1
    groups = []
    for members in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)):
        if len(members):
            groups.append(
                _build_group(
                    members,
                    len(query_lens),
                    query_lens,
                    seq_lens,
                    token_starts,
                    block_table,
                    block_size,
                    device,
                    flash_min_query_len,
                )
            )
    return AttentionMetadata(num_tokens, _to_device(slots, device), groups, kernels)


def _split_short_queries(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    token_starts: np.ndarray,
    block_table: np.ndarray,
    max_len: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each request whose query has 2..max_len tokens becomes that many one-token rows, the i-th a
    sequence of seq_len - query_len + 1 + i tokens over the request's blocks; the others stay whole.
    Rows keep the flat token order, so a step of decodes and drafts is still one in-order decode group."""
    split = (query_lens > 1) & (query_lens <= max_len)
    rows_per_request = np.where(split, query_lens, 1)
    request_of_row = np.repeat(np.arange(len(query_lens)), rows_per_request)
    is_split = split[request_of_row]
    offset = np.arange(len(request_of_row)) - np.repeat(
        np.cumsum(rows_per_request) - rows_per_request, rows_per_request
    )
    offset = np.where(is_split, offset, 0)
    q_lens = query_lens[request_of_row]
    row_seq_lens = np.where(
        is_split, seq_lens[request_of_row] - q_lens + 1 + offset, seq_lens[request_of_row]
    )
    return (
        np.where(is_split, 1, q_lens),
        row_seq_lens,
        token_starts[request_of_row] + offset,
        block_table[request_of_row],
    )


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _build_group(
    members,
    num_seqs_in_batch,
    query_lens,
    seq_lens,
    token_starts,
    block_table,
    block_size,
    device,
    flash_min_query_len,
) -> AttentionGroup:
    q_lens, s_lens, starts = query_lens[members], seq_lens[members], token_starts[members]
    num_seqs, max_q = len(members), int(q_lens.max())
    num_ctx_blocks = int(-(-s_lens.max() // block_size))
    if block_table.shape[1] < num_ctx_blocks:
        raise ValueError(f"block_table has {block_table.shape[1]} columns; sequences need {num_ctx_blocks}.")
    ctx_len = num_ctx_blocks * block_size

    # blocks beyond a request's own are masked out; point them at its first block so ids stay valid
    blocks = block_table[members, :num_ctx_blocks]
    is_own = np.arange(num_ctx_blocks)[None, :] * block_size < s_lens[:, None]
    blocks = np.where(is_own, blocks, blocks[:, :1])

    # query i of a request sits at context_start + i; padded query rows copy the last real row
    q_idx = np.minimum(np.arange(max_q)[None, :], q_lens[:, None] - 1)  # [num_seqs, max_q]
    query_positions = (s_lens - q_lens)[:, None] + q_idx

    token_index = out_rows = out_index = None
    if num_seqs < num_seqs_in_batch or bool((q_lens < max_q).any()):
        token_index = (starts[:, None] + q_idx).reshape(-1)
        out_rows = np.flatnonzero((np.arange(max_q)[None, :] < q_lens[:, None]).reshape(-1))
        out_index = token_index[out_rows]
    split = None  # decodes never go to torch's flash attention
    if max_q > 1:
        split = _prefill_split(q_lens, s_lens, starts, blocks, block_size, flash_min_query_len)
    return AttentionGroup(
        num_seqs=num_seqs,
        max_query_len=max_q,
        block_index=_to_device(blocks.reshape(-1), device),
        context_len=ctx_len,
        query_positions=query_positions,
        token_index=None if token_index is None else _to_device(token_index, device),
        out_rows=None if out_rows is None else _to_device(out_rows, device),
        out_index=None if out_index is None else _to_device(out_index, device),
        block_table=_to_device(block_table[members, :num_ctx_blocks].astype(np.int32), device),
        seq_lens=_to_device(s_lens, device),
        query_starts=_to_device(starts, device),
        query_lens=_to_device(q_lens, device),
        device=device,
        split=split,
    )


def _prefill_split(q_lens, s_lens, starts, blocks, block_size, min_len) -> PrefillSplit | None:
    if min_len is None:
        return None
    cached = s_lens - q_lens
    flash = (cached <= q_lens) & (s_lens >= min_len)
    if not flash.any():
        return None
    prompts = [
        WholePrompt(int(start), int(n), torch.from_numpy(row[: -(-int(s) // block_size)].copy()), int(c))
        for start, n, s, c, row in zip(
            starts[flash], q_lens[flash], s_lens[flash], cached[flash], blocks[flash], strict=True
        )
    ]
    rest = None
    if not flash.all():
        others = ~flash
        rest = (
            torch.from_numpy(blocks[others].astype(np.int32)),
            torch.from_numpy(starts[others]),
            torch.from_numpy(q_lens[others]),
            torch.from_numpy(s_lens[others]),
        )
    return PrefillSplit(prompts, flash.tolist(), rest)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    within: HugePageBuffer | None = None,
) -> list[torch.Tensor]:
    """One zeroed cache per layer, a row per (token, KV head) as nanoserve.model.kv_rows lays it out; on
    the CPU all in one buffer in huge pages (nanoserve.model.huge_pages), `within`'s where they fit."""
    shape = (2, num_kv_heads, num_blocks, block_size, row_width(head_dim, dtype))
    if device.type == "cpu":
        return huge_page_zeros(num_layers, shape, dtype, within)[0]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def copy_kv_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks, every layer's K and V, one (source, destination) pair after another: a later
    pair may read a block an earlier one wrote."""
    for source, destination in copies:
        for cache in kv_caches:
            cache[:, :, destination].copy_(cache[:, :, source])


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return num_layers * 2 * block_size * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata) -> None:
    """k, v: [T, num_kv_heads, head_dim] into their slots of the cache, as rows of its dtype
    (nanoserve.model.kv_rows). (With the C++ kernels, the model writes them while applying rotary
    embeddings instead.)"""
    _, num_kv_heads, num_blocks, block_size, row = kv_cache.shape
    slots = as_copyable(kv_cache.view(2, num_kv_heads, num_blocks * block_size, row))
    for kv, values in enumerate((k, v)):
        rows = as_copyable(encode(values.transpose(0, 1), kv_cache.dtype))
        slots[kv].index_copy_(1, attn.slot_mapping, rows)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attend each token over its request's context (its last `window` positions when given), its own K/V
    already in the cache.

    q: [T, num_heads, head_dim] -> [T, num_heads * head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    if len(attn.groups) == 1 and attn.groups[0].out_index is None:
        return _attend_group(q, kv_cache, attn.groups[0], attn.kernels, scale, window, softcap)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in attn.groups:
        assert group.out_index is not None, "a step of several groups maps each one's rows"
        out.index_copy_(
            0, group.out_index, _attend_group(q, kv_cache, group, attn.kernels, scale, window, softcap)
        )
    return out


def _attend_group(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    kernels: ModuleType | None,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1:]
    if group.is_decode and kernels is not None:
        if group.token_index is not None:
            q = q.index_select(0, group.token_index)
        return kernels.paged_decode_attention(
            q.contiguous(), kv_cache, group.block_table, group.seq_lens, scale, window or 0, softcap or 0.0
        )
    if kernels is not None and group.split is not None and window is None and softcap is None:
        return attend_split(q, kv_cache, group.split, kernels, scale)
    if kernels is not None:
        return kernels.paged_prefill_attention(
            q.contiguous(),
            kv_cache,
            group.block_table,
            group.query_starts,
            group.query_lens,
            group.seq_lens,
            scale,
            window or 0,
            softcap or 0.0,
        )
    blocks = kv_cache.view(2, kv_cache.shape[1], kv_cache.shape[2], -1)
    num_kv_heads = blocks.shape[1]
    per_kv = num_heads // num_kv_heads
    num_seqs, max_q, ctx = group.num_seqs, group.max_query_len, group.context_len
    # [2, num_kv_heads, num_seqs, ctx, head_dim], contiguous, in q's dtype: the one copy of the context per layer
    gathered = blocks.index_select(2, group.block_index).view(2, num_kv_heads, num_seqs, ctx, -1)
    kv = decode(gathered, q.dtype)
    if group.token_index is not None:
        q = q.index_select(0, group.token_index)
    # [num_seqs, max_q, num_kv_heads, per_kv, head_dim]
    q = q.view(num_seqs, max_q, num_kv_heads, per_kv, head_dim)

    if group.is_decode:
        # [num_kv_heads * num_seqs, per_kv, head_dim]: the heads sharing a KV head are the rows
        q = q.permute(2, 0, 1, 3, 4).reshape(num_kv_heads * num_seqs, per_kv, head_dim)
        k = kv[0].view(num_kv_heads * num_seqs, ctx, head_dim)
        v = kv[1].view(num_kv_heads * num_seqs, ctx, head_dim)
        bias = group.cached(
            ("bias", window, q.dtype),
            lambda: _additive(group.visible(window)[:, 0], q.dtype).view(1, num_seqs, 1, ctx),
        )
        scores = torch.bmm(q, k.transpose(1, 2)).view(num_kv_heads, num_seqs, per_kv, ctx).mul_(scale)
        probs = torch.softmax(_soft_cap(scores, softcap).add_(bias), dim=-1)
        out = torch.bmm(probs.view(-1, per_kv, ctx), v)  # [num_kv_heads * num_seqs, per_kv, head_dim]
        return out.view(num_kv_heads, num_seqs, per_kv * head_dim).transpose(0, 1).reshape(num_seqs, -1)

    # rows ordered (query, head-in-group) so each mask row repeats per_kv times
    q = q.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_q * per_kv, head_dim)
    # additive, so SDPA does not convert a boolean mask again in every layer
    mask = group.cached(
        ("mask", window, per_kv, q.dtype),
        lambda: _additive(group.visible(window).repeat_interleave(per_kv, dim=1).unsqueeze(1), q.dtype),
    )
    k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [num_seqs, num_kv_heads, ctx, head_dim]
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:  # SDPA has no soft-capping: the scores are written out
        scores = _soft_cap(torch.matmul(q, k.transpose(2, 3)).mul_(scale), softcap)
        out = torch.matmul(torch.softmax(scores.add_(mask), dim=-1), v)
    # [num_seqs, num_kv_heads, max_q, per_kv, head_dim] -> [num_seqs * max_q, num_heads * head_dim]
    out = (
        out.view(num_seqs, num_kv_heads, max_q, per_kv, head_dim)
        .transpose(1, 2)
        .reshape(num_seqs * max_q, -1)
    )
    return out if group.out_rows is None else out.index_select(0, group.out_rows)


def _soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores.div_(cap)).mul_(cap)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool -> 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )
