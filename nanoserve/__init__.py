"""nanoserve: a compact LLM inference and serving engine on vLLM V1's process architecture.

`LLM` is imported lazily so that `import nanoserve` (and the wire schema) stays free of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanoserve.config import EngineOptions
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from nanoserve.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineOptions",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    if name == "LLM":
        from nanoserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
