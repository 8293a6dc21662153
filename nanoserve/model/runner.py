"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache and samples.

Batch layout: the scheduled chunks' new tokens, flattened request after request. Index arrays are
built in numpy and moved to the device once per step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np
import torch

from nanoserve.config import EngineOptions
from nanoserve.model.attention import (
    allocate_kv_cache,
    build_attention_metadata,
    copy_kv_blocks,
    kv_cache_bytes_per_block,
)
from nanoserve.model.batch import RunnerOutput, ScheduledChunk, SchedulerOutput
from nanoserve.model.config import ModelConfig
from nanoserve.model.flash_prefill import choose_min_query_len
from nanoserve.model.freed_memory import return_freed_pages
from nanoserve.model.huge_pages import HUGE_PAGE, HugePageBuffer, PageWriter, huge_page_buffer
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.layers.causal_lm import CausalLM
from nanoserve.model.layers.linear import cpu_prepack_supported
from nanoserve.model.loader import load_model, load_model_config, resolve_dtype
from nanoserve.model.prefetch_choice import DEFAULT_DISTANCE, choose_weight_prefetch
from nanoserve.model.sampler import Sampler
from nanoserve.model.step_choice import choose_quantized_steps
from nanoserve.model_files import resolve_model_path

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions turned into full-vocabulary logprobs at a time (256 x 49152 floats = 48 MiB)."""
KV_CACHE_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
"""kv_cache_dtype's values other than auto (the model's dtype)."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def serving_config(config: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """The config with its positions cut to the max_model_len asked for: the rotary tables get no longer
    than that, and LongRoPE picks its short factors when that fits the pretraining length."""
    if max_model_len is None or max_model_len >= config.max_position_embeddings:
        return config
    return dataclasses.replace(config, max_position_embeddings=max_model_len)


class ModelRunner:
    RPC_METHODS = ("describe", "num_parameters", "weight_bytes_per_step")

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.device = resolve_device(options.device)
        self.model_path = resolve_model_path(options.model)
        self.dtype = resolve_dtype(options.dtype, self.device)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        if options.kv_cache_dtype == "bfloat16" and self.dtype == torch.float16:
            raise ValueError(
                "kv_cache_dtype='bfloat16' under a float16 model saves no bytes and loses precision; "
                "use kv_cache_dtype='auto' (or dtype='float32')."
            )
        self.kv_cache_dtype = KV_CACHE_TORCH_DTYPES.get(options.kv_cache_dtype, self.dtype)
        self.kv_caches: list[torch.Tensor] = []
        self._kv_buffer: HugePageBuffer | None = None
        """The KV cache's memory, taken before the model's config is read so that its pages are written
        meanwhile (nanoserve.model.huge_pages); the caches are carved from it."""
        self._kv_writer: PageWriter | None = None
        if self.device.type == "cpu" and options.num_kv_blocks is None:
            # the slack: room for each layer's cache to start on a cache line
            self._kv_buffer = huge_page_buffer(options.kv_cache_budget + HUGE_PAGE)
            self._kv_writer = PageWriter([self._kv_buffer.data])
        try:
            self.config = serving_config(load_model_config(self.model_path), options.max_model_len)
        except BaseException:
            self.free_kv_cache()
            raise
        self.vocab_size = self.config.vocab_size
        self.max_model_len = self.config.max_position_embeddings
        self.sliding_window = self.config.kv_window
        """KV blocks that fall behind it are freed (None: some layer reads the whole context)."""
        self.kernels = None
        if options.cpu_kernels != "off" and self.device.type == "cpu" and self.dtype != torch.float16:
            self.kernels = cpu_kernels()
        self.model: CausalLM | None = None
        """None until load_weights, and after sleep(level=2) dropped the weights."""
        self.sampler = Sampler(options.seed, self.kernels)
        self.flash_min_query_len: int | None = None
        """Prompts whose context is at least this long attend through torch's flash attention (see
        flash_prefill); chosen by load_weights."""
        self.max_decode_query_len = 1 + options.spec_num_tokens if options.speculative != "none" else 1
        """A decode with its drafts is verified on the decode path (see build_attention_metadata)."""
        self._offloaded: dict[str, torch.Tensor] | None = None

    def load_weights(self) -> None:
        """Load the model (again, after sleep level 2 dropped it), once the KV cache's pages are written:
        loading times kernels (the start-up measurements, cached per CPU), which must not share the
        cores with that."""
        start = time.perf_counter()
        self.model = self._load()
        return_freed_pages()  # the temporaries of loading (nanoserve.model.freed_memory)
        kv_name = str(self.kv_cache_dtype).removeprefix("torch.")
        kv_note = "" if self.kv_cache_dtype == self.dtype else f", KV cache {kv_name}"
        logger.info(
            "loaded %s (%s%s) in %.1f s",
            self.config.name,
            self.dtype_name,
            kv_note,
            time.perf_counter() - start,
        )

    def _load(self) -> CausalLM:
        options = self.options
        self.wait_for_kv_cache()
        if self.kernels is not None:
            c = self.config
            self.flash_min_query_len = choose_min_query_len(
                self.kernels,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                self.dtype,
                options.block_size,
                kv_dtype=self.kv_cache_dtype,
            )
        model = load_model(
            self.model_path,
            self.config,
            self.dtype,
            self.device,
            options.quantization,
            self.kernels,
            options.matmul_choice,
        )
        if self.kernels is not None:
            if options.matmul_choice == "auto":
                # timed on the fused decoder, whichever path the engine runs: the limits (and so the
                # tokens) must not depend on cpu_kernels
                model.use_cpu_kernels(self.kernels)
                choose_weight_prefetch(model, self.kernels, self.dtype)  # before timing whole steps on it
                choose_quantized_steps(
                    model, self.kernels, self.dtype, options.block_size, self.kv_cache_dtype
                )
                if cpu_prepack_supported(self.dtype, self.device):
                    model.repack_for_quantized_steps(self.kernels)
            else:
                self.kernels.set_weight_prefetch_bytes(DEFAULT_DISTANCE)
                model.drop_unread_packed()
            model.use_cpu_kernels(self.kernels, fused_decode=options.cpu_kernels == "auto")
        return model

    def _loaded(self) -> CausalLM:
        if self.model is None:
            raise RuntimeError("The model's weights were dropped (sleep level 2); wake the engine up first.")
        return self.model

    # -- KV cache and memory ------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        c = self.config
        return kv_cache_bytes_per_block(
            c.num_layers, self.options.block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """On the CPU every page of the cache is written ahead, on a thread (nanoserve.model.huge_pages):
        a page first touched by a prompt's own writes costs it a fault. Call wait_for_kv_cache before
        serving."""
        c = self.config
        reserved, self._kv_buffer = self._kv_buffer, None
        self.kv_caches = allocate_kv_cache(
            c.num_layers,
            num_blocks,
            self.options.block_size,
            c.num_kv_heads,
            c.head_dim,
            self.kv_cache_dtype,
            self.device,
            within=reserved,
        )
        carved = reserved is not None and self.kv_caches[0].data_ptr() == reserved.data.data_ptr()
        if self.device.type == "cpu" and not carved:
            self.wait_for_kv_cache()
            self._kv_writer = PageWriter(self.kv_caches)

    def wait_for_kv_cache(self) -> None:
        """Until every page of the KV cache is written."""
        if self._kv_writer is not None:
            self._kv_writer.join()
            self._kv_writer = None

    def free_kv_cache(self) -> None:
        """Drop the cache (and its reserved memory), its pages' writer stopped first."""
        if self._kv_writer is not None:
            self._kv_writer.stop()
            self._kv_writer = None
        self._kv_buffer = None
        self.kv_caches = []

    def offload_weights(self) -> None:
        """Move weights to host memory (a no-op copy on CPU) so the device is free while asleep."""
        if self.device.type != "cpu":
            self._loaded().to("cpu")

    def drop_weights(self) -> None:
        self.model = None

    def restore_weights(self) -> None:
        if self.model is None:
            self.load_weights()
        elif self.device.type != "cpu":
            self._loaded().to(self.device)

    # -- worker RPCs --------------------------------------------------------------------------

    def describe(self) -> dict:
        return {"model": self.config.name, "dtype": self.dtype_name, "device": str(self.device)}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._loaded().parameters())

    def weight_bytes_per_step(self, num_seqs: int) -> int:
        """Weight bytes a decode step of num_seqs sequences reads (see CausalLM.weight_bytes_per_step)."""
        return self._loaded().weight_bytes_per_step(num_seqs, num_seqs)

    def save_state(self, path: str) -> None:
        """Write the loaded weights as one safetensors file (there is one shard: no tensor parallelism)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self._loaded().state_dict().items()}
        save_file(state, os.path.join(path, "model-rank-0.safetensors"))

    # -- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        copy_kv_blocks(self.kv_caches, scheduled.block_copies)
        chunks = scheduled.chunks
        hidden = self._forward(chunks)
        prompt_logprobs = self._prompt_logprobs(chunks, hidden)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return RunnerOutput([], [], [], prompt_logprobs)
        drafts = [chunks[i].draft_token_ids for i in sampling]
        if len(sampling) + sum(map(len, drafts)) < len(hidden):
            chunk_ends = np.cumsum([c.num_new_tokens for c in chunks])[sampling]
            rows = torch.from_numpy(_sampled_rows(chunk_ends, drafts)).to(self.device)
            hidden = hidden.index_select(0, rows)
        # else every row is a sampling chunk's last known token or a draft, in order: all of hidden
        logits = self._loaded().compute_logits(hidden).float().cpu()
        requests = [chunks[i].request for i in sampling]
        bitmask = scheduled.grammar_bitmask.result() if scheduled.grammar_bitmask is not None else None
        token_lists, logprobs = self.sampler.sample_and_verify(logits, requests, drafts, bitmask)
        return RunnerOutput([r.request_id for r in requests], token_lists, logprobs, prompt_logprobs)

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The chunks' tokens, request after request (known tokens, then drafts), through the model ->
        final hidden states [tokens, hidden]; their K/V go into the cache."""
        query_lens = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter(
            (c.request.num_computed_tokens for c in chunks), dtype=np.int64, count=len(chunks)
        )
        seq_lens = starts + query_lens
        num_tokens = sum(c.num_new_tokens for c in chunks)
        plain_decode = num_tokens == len(chunks)  # one token per request, no drafts

        if plain_decode:
            token_ids = [c.request.all_token_ids[c.request.num_computed_tokens] for c in chunks]
            positions = starts
        else:
            token_ids = []
            for c in chunks:
                first = c.request.num_computed_tokens
                token_ids.extend(c.request.all_token_ids[first : first + c.num_known_tokens])
                token_ids.extend(c.draft_token_ids)
            cu_query = np.cumsum(query_lens) - query_lens
            positions = np.arange(num_tokens) - np.repeat(cu_query - starts, query_lens)

        max_blocks = max(len(c.block_ids) for c in chunks)
        block_table = np.zeros((len(chunks), max_blocks), dtype=np.int32)
        for i, c in enumerate(chunks):
            block_table[i, : len(c.block_ids)] = c.block_ids

        model = self._loaded()
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        if model.fused_decoder is not None and (plain_decode or all(c.num_known_tokens == 1 for c in chunks)):
            # one decode row per token, a draft's row ending at the draft: the fused decode step looks up
            # what it needs itself, with no attention metadata
            row_block_table = block_table if plain_decode else block_table.repeat(query_lens, 0)
            return model.decode(
                input_ids,
                self.kv_caches,
                torch.from_numpy(row_block_table),
                torch.from_numpy(positions + 1),
            )
        attn = build_attention_metadata(
            query_lens,
            seq_lens,
            block_table,
            self.options.block_size,
            self.device,
            self.kernels,
            self.max_decode_query_len,
            self.flash_min_query_len,
        )
        positions_t = torch.from_numpy(positions).to(self.device, non_blocking=True)
        return model(input_ids, positions_t, self.kv_caches, attn)

    def _prompt_logprobs(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[str, list[list[tuple[int, float]]]]:
        """For chunks of requests that asked for prompt logprobs: each prompt token's logprob given the
        tokens before it (from the hidden state one position earlier) and the top ones there. Plain Python
        over the chunks: after a decode step has streamed the weights through the caches, a first numpy
        call costs tens of microseconds, and at batch 1 this runs every step."""
        result: dict[str, list[list[tuple[int, float]]]] = {}
        chunk_start = 0  # the chunk's first row in hidden
        for chunk in chunks:
            if chunk.request.needs_prompt_logprobs:
                result[chunk.request.request_id] = self._chunk_prompt_logprobs(chunk, hidden, chunk_start)
            chunk_start += chunk.num_new_tokens
        return result

    def _chunk_prompt_logprobs(
        self, chunk: ScheduledChunk, hidden: torch.Tensor, chunk_start: int
    ) -> list[list[tuple[int, float]]]:
        """The prompt logprobs of the positions one chunk computes, its rows of hidden from chunk_start."""
        request = chunk.request
        start = request.num_computed_tokens
        # positions whose next token is a prompt token not yet covered
        first = max(start, len(request.prompt_logprobs))
        end = min(start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
        entries: list[list[tuple[int, float]]] = []
        num_top = request.sampling_params.prompt_logprobs or 0
        for lo in range(first, end, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
            rows = hidden[chunk_start + lo - start : chunk_start + hi - start]
            logprobs = torch.log_softmax(self._loaded().compute_logits(rows).float(), dim=-1).cpu()
            targets = torch.tensor(request.all_token_ids[lo + 1 : hi + 1])
            target_lp = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_lp, top_ids = logprobs.topk(num_top, dim=-1)
            for k, (token, lp) in enumerate(zip(targets.tolist(), target_lp, strict=True)):
                top = zip(top_ids[k].tolist(), top_lp[k].tolist(), strict=True)
                entries.append([(token, lp), *top])
        return entries


def _sampled_rows(chunk_ends: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """Flat token rows whose logits are sampled: each sampling chunk's last 1 + len(draft) rows (its
    last known token, then its drafts), chunk after chunk. chunk_ends: each chunk's end row + 1."""
    counts = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    firsts = np.repeat(chunk_ends - counts, counts)
    return firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
