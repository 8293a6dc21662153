"""`nanoserve bench prefix`: what a prefix-cache lookup costs at admission as the cache fills, model-free.

A chat server's cache holds many conversations under one system prompt, and each user turn starts with
the same template tokens: after the system prompt's whole blocks, every cached turn's next block is a
partial-hit candidate for a new request (KVCacheManager). For each count of cached turns this fills a
KVCacheManager with that many (system prompt, template, random turn) prompts, then times
`get_computed_blocks` for fresh turns of the same shape, and prints microseconds per lookup beside the
tokens each lookup found cached (the system prompt's blocks plus the template).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from nanoserve.core.kv_cache import KVCacheManager
from nanoserve.core.request import Request
from nanoserve.sampling_params import SamplingParams

TEMPLATE = [7, 8, 9]
"""The tokens every user turn starts with (a chat template's header)."""
VOCAB = 49152


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=1), (), 0.0, 1)


def turn(rng: random.Random, system: list[int], block_size: int) -> list[int]:
    """The system prompt, the template, then the rest of a block and one token more of the user's own."""
    return system + TEMPLATE + [rng.randrange(VOCAB) for _ in range(block_size - len(TEMPLATE) + 1)]


def fill(cached_turns: int, system: list[int], block_size: int, rng: random.Random) -> KVCacheManager:
    """A prefix cache holding `cached_turns` finished turns under one system prompt."""
    blocks_per_turn = -(-(len(system) + block_size + 1) // block_size)
    kv = KVCacheManager(cached_turns * blocks_per_turn + 16, block_size, enable_prefix_caching=True)
    for i in range(cached_turns):
        request = make_request(f"cached-{i}", turn(rng, system, block_size))
        num_cached = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, request.num_tokens - num_cached, num_cached)
        request.num_computed_tokens = request.num_tokens
        kv.cache_computed_blocks(request)
        kv.free(request)
    return kv


def time_lookups(kv: KVCacheManager, requests: list[Request]) -> tuple[float, float]:
    """Seconds per `get_computed_blocks`, and the mean number of cached tokens it found."""
    start = time.perf_counter()
    found = [kv.get_computed_blocks(r) for r in requests]
    return (time.perf_counter() - start) / len(requests), statistics.mean(found)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench prefix", description=__doc__)
    parser.add_argument("--cached-turns", type=int, nargs="+", default=[10, 100, 1000, 4000])
    parser.add_argument("--lookups", type=int, default=200, help="fresh turns timed per count")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--system-blocks", type=int, default=2, help="whole blocks of system prompt")
    args = parser.parse_args(argv)

    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(args.system_blocks * args.block_size)]
    print("| cached turns | µs per lookup | tokens found cached |")
    print("|-------------:|--------------:|--------------------:|")
    for cached_turns in args.cached_turns:
        kv = fill(cached_turns, system, args.block_size, rng)
        fresh = [make_request(f"new-{i}", turn(rng, system, args.block_size)) for i in range(args.lookups)]
        seconds, found = time_lookups(kv, fresh)
        print(f"| {cached_turns} | {seconds * 1e6:.1f} | {found:.1f} |", flush=True)
