"""Drives a model through scheduled steps over a paged KV cache, the way the engine does, keeping logits."""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.model.attention import allocate_kv_cache, build_attention_metadata

BLOCK_SIZE = 4
ATOL = 1e-4


class PagedDriver:
    """Runs scheduled steps through the model, keeping every logit row it computed per sequence."""

    def __init__(
        self,
        model,
        prompts: list[list[int]],
        num_blocks: int = 64,
        seed: int = 0,
        kernels=None,
        flash_min_query_len: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """kv_dtype: the cache's (None: the model's)."""
        cfg = model.config
        self.model = model
        self.kernels = kernels
        self.flash_min_query_len = flash_min_query_len
        self.kv_caches = allocate_kv_cache(
            cfg.num_layers,
            num_blocks,
            BLOCK_SIZE,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype or model.embed_tokens.weight.dtype,
            torch.device("cpu"),
        )
        self.free_blocks = list(np.random.default_rng(seed).permutation(num_blocks))
        self.blocks: list[list[int]] = [[] for _ in prompts]
        self.tokens = [list(p) for p in prompts]
        self.num_computed = [0] * len(prompts)
        self.logits: list[list[torch.Tensor]] = [[] for _ in prompts]

    def step(self, schedule: dict[int, int]) -> None:
        """schedule: sequence index -> number of its next tokens to run this step."""
        seq_ids = list(schedule)
        query_lens = np.array([schedule[s] for s in seq_ids])
        seq_lens = np.array([self.num_computed[s] + schedule[s] for s in seq_ids])
        for s, n in zip(seq_ids, seq_lens, strict=True):
            while len(self.blocks[s]) * BLOCK_SIZE < n:
                self.blocks[s].append(self.free_blocks.pop())
        block_table = np.zeros((len(seq_ids), max(len(self.blocks[s]) for s in seq_ids) + 1), dtype=np.int32)
        for row, s in enumerate(seq_ids):
            block_table[row, : len(self.blocks[s])] = self.blocks[s]
        ids = [
            t
            for s in seq_ids
            for t in self.tokens[s][self.num_computed[s] : self.num_computed[s] + schedule[s]]
        ]
        positions = [
            p for s in seq_ids for p in range(self.num_computed[s], self.num_computed[s] + schedule[s])
        ]
        attn = build_attention_metadata(
            query_lens,
            seq_lens,
            block_table,
            BLOCK_SIZE,
            torch.device("cpu"),
            self.kernels,
            flash_min_query_len=self.flash_min_query_len,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, attn)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.config.vocab_size)
        start = 0
        for s, n in zip(seq_ids, query_lens, strict=True):
            self.logits[s].extend(logits[start : start + n])
            start += n
            self.num_computed[s] += int(n)
            if self.num_computed[s] == len(self.tokens[s]):
                self.tokens[s].append(int(self.logits[s][-1].argmax()))

    def check_against(self, hf_model) -> None:
        for s, rows in enumerate(self.logits):
            with torch.inference_mode():
                ref = hf_model(torch.tensor([self.tokens[s][: len(rows)]])).logits[0]
            torch.testing.assert_close(torch.stack(rows), ref, atol=ATOL, rtol=0)
