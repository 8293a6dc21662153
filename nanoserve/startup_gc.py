"""Start-up and the cyclic garbage collector.

Importing torch and transformers and building an engine makes some 700,000 objects that live as long as
the process. While they pile up, Python runs a full collection each time the long-lived heap has grown
by a quarter: 8-9 of them in each of `nanoserve serve`'s two processes, about a second of CPU in each on
a Zen 5. With the collector paused for the start, its next young collection looks at what was built
once. A process nanoserve owns (an engine core, the server) instead collects once and freezes what
survives, so that later collections, which stall a step or every stream at once, never walk it again.
In a user's process (`LLM`, `AsyncLLM`) nothing is frozen: the heap is theirs.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Generator

_paused_here = False
"""Whether collector_paused turned the collector off (and so must turn it on again)."""


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Generator[None]:
    """Pause the cyclic collector for the block; with `freeze`, once the block has run, collect once and
    freeze the survivors. Where the collector is already off, paused by an outer block or by the user, it
    is left to them. A process forked inside the block starts with the collector on."""
    global _paused_here
    if not gc.isenabled():
        yield
        return
    gc.disable()
    _paused_here = True
    try:
        yield
        if freeze:
            gc.collect()
            gc.freeze()
    finally:
        _paused_here = False
        gc.enable()


def _resume_in_child() -> None:
    global _paused_here
    if _paused_here:
        _paused_here = False
        gc.enable()


os.register_at_fork(after_in_child=_resume_in_child)
