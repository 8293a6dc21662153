"""C++ CPU kernels, compiled on first use for the machine they run on (torch's JIT extension build).

The build takes about half a minute once and is cached under torch's extension folder
(TORCH_EXTENSIONS_DIR); `python -m nanoserve.model.kernels` builds it ahead of time (make setup does).
Where it cannot be built (no compiler), the engine keeps to its pure-PyTorch paths.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
"""-ffast-math lets the compiler vectorize the float reductions (sums in any order)."""


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The module with `paged_decode_attention(q [S, H, D], kv_cache, block_table int32 [S, B], seq_lens
    int64 [S], scale) -> [S, H * D]` and `rms_norm(x [T, hidden], weight, eps)`, bfloat16 or float32;
    None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        return load("nanoserve_cpu_kernels", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:  # a missing compiler or headers: fall back, loudly once
        logger.warning("the C++ CPU kernels could not be built (%s); using PyTorch ops", e)
        return None
