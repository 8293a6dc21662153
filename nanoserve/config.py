"""EngineOptions: the engine options a user passes, under the same names in LLM, AsyncLLM and the CLI.

Values the engine discovers at start-up (KV blocks, fitted max_model_len) are not written back here;
they come back in `EngineCoreReadyResponse`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nanoserve import envs

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e5m2", "int8")
RUNNERS = ("model", "null")
DEFAULT_KV_CACHE_BYTES = 1 << 30
QUANTIZATIONS = ("none", "auto", "int4", "int8")
CPU_KERNEL_MODES = ("auto", "unfused", "off")
MATMUL_CHOICES = ("auto", "fixed")
START_METHODS = ("spawn", "forkserver", "fork")
ENGINE_ALLOCATORS = ("auto", "jemalloc", "system")
TRANSPORTS = ("ipc", "tcp")
DP_BACKENDS = ("mp", "ray")
SPECULATIVE_METHODS = ("none", "ngram")
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class EngineOptions:
    model: str | None = None
    """HF folder or .gguf file; None selects the bundled SmolLM2-135M-Instruct GGUF."""
    dtype: str = "auto"
    """auto: bfloat16 where the CPU supports it natively (or on CUDA), else float32."""
    kv_cache_dtype: str = "auto"
    """auto: the model's dtype. bfloat16: cached K and V rounded to bfloat16 under a float32 model (dtype
    auto on a CPU without native bf16): half the bytes per cached token, so twice the tokens fit and
    decode attention reads half as much; tokens may differ from a float32 cache's. Under a bfloat16 model
    it is the model's own dtype; under float16 it is refused (no bytes saved, three mantissa bits lost).
    int8 and fp8_e5m2, under any model dtype: a byte per value, so about twice a bf16 cache's tokens fit
    and long-context decode reads half the bytes. int8: each token's K (and V) row of each KV head as
    8-bit codes with a float32 scale of its own (4 bytes a row), close to bf16 in the tokens it gives.
    fp8_e5m2: 8-bit floats (5 exponent bits, 2 mantissa bits, no scale), about 2 significant bits a value,
    so greedy tokens part from an exact cache's much sooner."""
    max_model_len: int | None = None
    """None: the model's own limit, reduced to what the KV cache can hold."""
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    """KV cache budget; default 1 GiB unless num_kv_blocks is given."""
    enable_prefix_caching: bool = True
    seed: int = 0
    multiprocess_mode: bool = field(default_factory=envs.enable_multiprocessing)
    """Run the engine core in a child process (the default, as in vLLM); NANOSERVE_ENABLE_MULTIPROCESSING=0
    or False selects the in-process engine."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    num_threads: int | None = None
    """torch intra-op threads for the engine; None uses all cores the process may run on."""
    quantization: str = "none"
    """int4 / int8: 4- or 8-bit weights in groups of 32 for steps of up to 64 tokens on CPU (decode),
    bf16 for bigger ones; with the C++ kernels activations go to int8 too, without them int4 only
    (torch's kernel). A GGUF file's Q4_0/Q4_1 (int4) or Q8_0 (int8) codes load as they are; auto keeps
    each of its matrices in the file's own format (none for HF folders). See nanoserve.model.quant."""
    cpu_kernels: str = "auto"
    """auto: decode attention, RMSNorm, rotary embedding and activations in C++ kernels compiled on first
    use (CPU, bfloat16/float32) where they build, and decode steps of Llama- and Gemma-shaped models and
    mixtures of experts (and their prefill steps whose attention is all on the C++ kernel) as one fused
    C++ call (nanoserve.model.layers.fused_decoder); unfused: the same kernels called layer by layer from
    the PyTorch modules; off: PyTorch ops only."""
    matmul_choice: str = "auto"
    """With quantization: auto measures, once per CPU and weight shape (cached beside the kernel builds),
    the step sizes up to which each quantized matmul beats the unquantized one and uses it there; fixed:
    the quantized kernel at every step size (quant_matmul; torch's int4 kernel up to 16 tokens) and the
    8-bit lm_head up to 4 rows. See nanoserve.model.matmul_choice; auto then also times whole decode
    steps all quantized, which can raise those limits (nanoserve.model.step_choice), and how far ahead
    the quantized kernels prefetch their weights (nanoserve.model.prefetch_choice; fixed: 4 KB). With
    or without quantization, auto also measures which blocked layout oneDNN's bf16 weights are packed
    in (nanoserve.model.pack_choice); fixed keeps the layout for batch 1."""
    speculative: str = "none"
    """ngram: speculative decoding by prompt lookup (nanoserve.core.speculator): up to
    `num_speculative_tokens` tokens that followed the latest earlier occurrence of the sequence's last
    n-gram are checked in one forward pass; output is what plain decoding gives."""
    num_speculative_tokens: int | None = None
    """Draft tokens per request and step (default 3); only with speculative="ngram"."""
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    """The longest and shortest n-gram matched (default 4 and 2); only with speculative="ngram"."""
    runner: str = "model"
    """model: the real transformer. null: a model-free runner (one token per request per step) used by
    the IPC benchmark and client tests."""
    engine_start_method: str = "spawn"
    """How the multiprocess client starts engine-core processes (multiprocessing start method)."""
    engine_allocator: str = "auto"
    """The malloc of engine-core processes (nanoserve.engine.core_client.allocator): jemalloc preloads
    jemalloc (needs multiprocess_mode, the mp backend and the spawn start method); auto does so where
    the library is found, those hold and no LD_PRELOAD is set; system keeps the C library's malloc."""
    transport: str = "ipc"
    """ipc: Unix sockets in the temp dir; tcp: loopback ports chosen by the kernel."""
    zmq_curve: bool = True
    """Authenticate and encrypt every tcp:// socket between frontend, engines and coordinator with
    CurveZMQ (keys made per run); False sends plaintext to anyone who reaches the ports (a warning is
    logged): only for a trusted network. ipc:// is never encrypted (its files guard it)."""
    shutdown_timeout: float = 0.0
    """Seconds an engine core keeps serving in-flight requests after SIGTERM before aborting them."""
    engine_restarts: int = 0
    """How many times a dead engine core is restarted within `engine_restart_window` seconds, its
    unfinished requests resumed where they were; 0: a death is final (needs multiprocess_mode)."""
    engine_restart_window: float = 600.0
    """The window of the restart budget, in seconds."""
    data_parallel_size: int = 1
    """Number of engine-core replicas (data-parallel ranks); more than one needs multiprocess_mode."""
    data_parallel_rank: int | None = None
    """With an external load balancer: the one rank this frontend serves. None otherwise."""
    data_parallel_external_lb: bool = False
    """True: one rank per frontend, an external balancer in front. False: this frontend balances all ranks."""
    data_parallel_backend: str = "mp"
    """mp: engine cores as child processes of the frontend. ray: Ray actors, one placement group per rank,
    on this machine or across a Ray cluster (needs the `ray` extra)."""
    ray_address: str | None = None
    """data_parallel_backend="ray": the Ray cluster to join; None starts a local one (or uses the Ray this
    process is already connected to)."""
    ray_placement_strategy: str | None = None
    """data_parallel_backend="ray": how Ray places the ranks' bundles (one per rank, in one placement
    group): PACK (the default: as few nodes as fit), SPREAD, STRICT_PACK (one node) or STRICT_SPREAD
    (every rank on its own node)."""
    ray_ship_model: bool = False
    """data_parallel_backend="ray": send the model's files through Ray's object store to each node
    (models up to 2 GiB) instead of reading it at the same path on every node."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}.")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_MODES}, got {self.cpu_kernels!r}.")
        if self.matmul_choice not in MATMUL_CHOICES:
            raise ValueError(f"matmul_choice must be one of {MATMUL_CHOICES}, got {self.matmul_choice!r}.")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}.")
        if self.engine_start_method not in START_METHODS:
            raise ValueError(
                f"engine_start_method must be one of {START_METHODS}, got {self.engine_start_method!r}."
            )
        self._validate_engine_allocator()
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}.")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}.")
        if self.engine_restarts < 0:
            raise ValueError(f"engine_restarts must be non-negative, got {self.engine_restarts}.")
        if self.engine_restart_window <= 0:
            raise ValueError(f"engine_restart_window must be positive, got {self.engine_restart_window}.")
        if self.engine_restarts and not self.multiprocess_mode:
            raise ValueError(
                "engine_restarts needs multiprocess_mode: an engine core in the frontend's own process "
                "dies with it."
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}.")
        self._validate_data_parallel()
        self._validate_speculative()

    def _validate_engine_allocator(self) -> None:
        if self.engine_allocator not in ENGINE_ALLOCATORS:
            raise ValueError(
                f"engine_allocator must be one of {ENGINE_ALLOCATORS}, got {self.engine_allocator!r}."
            )
        if self.engine_allocator == "jemalloc" and not (
            self.multiprocess_mode
            and self.engine_start_method == "spawn"
            and self.data_parallel_backend == "mp"
        ):
            raise ValueError(
                "engine_allocator='jemalloc' needs multiprocess_mode, engine_start_method='spawn' and "
                "data_parallel_backend='mp': only a spawned engine-core process can start on another malloc."
            )

    def _validate_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}.")
        knobs = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
        if self.speculative == "none":
            given = [name for name in knobs if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} needs speculative='ngram'.")
            return
        for name in knobs:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.spec_lookup_min > self.spec_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.spec_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.spec_lookup_max})."
            )

    @property
    def kv_cache_budget(self) -> int:
        """The bytes the KV cache is sized to where num_kv_blocks is not given (default 1 GiB)."""
        return self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES

    @property
    def spec_num_tokens(self) -> int:
        return self.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS

    @property
    def spec_lookup_max(self) -> int:
        return self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP_MAX

    @property
    def spec_lookup_min(self) -> int:
        return self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MIN

    def _validate_data_parallel(self) -> None:
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}.")
        if self.data_parallel_backend not in DP_BACKENDS:
            raise ValueError(
                f"data_parallel_backend must be one of {DP_BACKENDS}, got {self.data_parallel_backend!r}."
            )
        if self.data_parallel_external_lb and rank is None:
            raise ValueError(
                "data_parallel_external_lb needs data_parallel_rank: the rank this frontend serves."
            )
        if rank is not None:
            if not self.data_parallel_external_lb:
                raise ValueError("data_parallel_rank is only meaningful with data_parallel_external_lb.")
            if not 0 <= rank < size:
                raise ValueError(f"data_parallel_rank must be in [0, {size}), got {rank}.")
        if self.data_parallel_backend != "ray":
            for name, unset in (
                ("ray_address", None),
                ("ray_placement_strategy", None),
                ("ray_ship_model", False),
            ):
                if getattr(self, name) != unset:
                    raise ValueError(f"{name} is only meaningful with data_parallel_backend='ray'.")
        strategy = self.ray_placement_strategy
        if strategy is not None and strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}, got {strategy!r}."
            )
        if self.data_parallel_backend == "ray" and not self.multiprocess_mode:
            raise ValueError("data_parallel_backend='ray' needs multiprocess_mode: each rank is a Ray actor.")
        if size > 1 and not self.multiprocess_mode:
            raise ValueError(
                "data_parallel_size > 1 needs multiprocess_mode: each rank is an engine-core process."
            )

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> EngineOptions:
        """Build options from keyword arguments, naming any unknown option."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"Unknown engine option(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}."
            )
        return cls(model=model, **kwargs)
