"""C++ CPU kernels, compiled on first use for the machine they run on (torch's JIT extension build).

The build runs once and takes minutes on a small machine (4-5 on 2 Zen 1 cores); `python -m
nanoserve.model.kernels` does it ahead of time (make setup does). The library lands in NANOSERVE_KERNEL_DIR (default ~/.cache/nanoserve/kernels) under
a name that hashes the source, the flags and the CPU (`-march=native` code built on one CPU may not run on
another that shares the home folder), and a later process imports it directly: torch's loader would
take a lock file and rerun ninja in every engine start, and a process killed while holding that lock
leaves every later start waiting on it. Every change of source, flags, torch or CPU makes a new build of
about 9 MB, so a new build removes all but the KEPT_BUILDS most recently used. Where the kernels cannot be
built (no compiler), the engine keeps to its pure-PyTorch paths.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
from pathlib import Path
from types import ModuleType

from nanoserve import envs

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.cpp",
        "prefill_attention.cpp",
        "quant_matmul.cpp",
        "dense_matmul.cpp",
        "packed_linear.cpp",
        "fused_decoder.cpp",
        "sampling.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("kernels.h", "vec16.h", "work_split.h", "quant_avx2.h", "quant_avx512.h")
]
PREFIX = "nanoserve_cpu_kernels_"
KEPT_BUILDS = 8
"""Builds kept in the cache: a machine's own and those of the CPUs that share its home folder, or that
tests/other_cpus.py stands in for (four on an AVX-512 machine)."""
FLAGS = ["-O3", "-ffast-math", "-fopenmp"]
"""-ffast-math lets the compiler vectorize the float reductions (sums in any order)."""


def build_dir() -> Path:
    return envs.kernel_dir()


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_identity() -> str:
    """The CPU model and feature flags `-march=native` compiles for (Linux: from /proc/cpuinfo)."""
    fields = cpu_fields()
    if not fields:
        return platform.machine() + platform.processor()
    return " ".join((platform.machine(), fields.get("model name", ""), fields.get("flags", "")))


def build_flags() -> list[str]:
    """FLAGS, the target (-march=native unless NANOSERVE_KERNEL_ARCH names another), and the vector width
    for the loops the compiler vectorizes itself (norms, residual adds, rotary, activations), where GCC's
    tuning for the CPU picks one that runs them slower:
    - 512 bits on Intel CPUs with AVX-512, where -march=native tunes for 256. On a two-core Xeon with AMX,
      silu_and_mul over 512 rows of 1536 columns took 203-210 us instead of 277-279, add_rms_norm over
      512 rows 51 us instead of 67.
    - 256 bits on AMD Zen 1 (family 23, models below 0x30), where it tunes for 128: Zen 1 runs a 256-bit
      instruction as two 128-bit halves, but twice the instructions cost more than the split. On an AMD
      EPYC Zen 1 the batch-1 decode step's single-thread loops (norms, rotary, silu, softmax) took 0.44 ms
      a step where they took 0.52; silu_and_mul over 1536 columns 3.1-3.4 us instead of 4.4-4.9."""
    fields = cpu_fields()
    vendor, flags = fields.get("vendor_id"), fields.get("flags", "").split()
    target = [*FLAGS, f"-march={envs.kernel_arch()}"]
    if vendor == "GenuineIntel" and "avx512f" in flags:
        return [*target, "-mprefer-vector-width=512"]
    zen1 = (
        vendor == "AuthenticAMD" and fields.get("cpu family") == "23" and int(fields.get("model", "0")) < 0x30
    )
    return [*target, "-mprefer-vector-width=256"] if zen1 else target


def library_name(cpu: str) -> str:
    """Where a build lives: one per source, flags, torch version and CPU."""
    import torch

    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    digest.update(" ".join(build_flags()).encode() + torch.__version__.encode() + cpu.encode())
    return f"{PREFIX}{digest.hexdigest()[:12]}"


def mark_used(folder: Path) -> None:
    """A build's folder's time is when a process last loaded it (a read-only cache keeps its own)."""
    try:
        os.utime(folder)
    except OSError:
        pass


def last_used(folder: Path) -> float:
    """0 for a folder that another process removed meanwhile."""
    try:
        return folder.stat().st_mtime
    except OSError:
        return 0.0


def prune_builds(keep: Path) -> None:
    """Removes all but the KEPT_BUILDS most recently used builds, never `keep` (the one just built)."""
    builds = [folder for folder in build_dir().glob(PREFIX + "*") if folder.is_dir() and folder != keep]
    builds.sort(key=last_used, reverse=True)
    for folder in builds[KEPT_BUILDS - 1 :]:
        logger.info("removing the kernel build %s, the least recently used", folder.name)
        shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The module with `paged_decode_attention(q [S, H, D], kv_cache, block_table int32 [S, B], seq_lens
    int64 [S], scale, window, softcap) -> [S, H * D]` (window, softcap 0: none), its prefill twin
    `paged_prefill_attention(q [T, H, D], kv_cache, block_table, query_starts, query_lens, seq_lens, scale,
    window, softcap) -> [sum(query_lens), H * D]`, `rope_write_kv(qkv, cos_sin,
    kv_cache, slot_mapping, H, Hkv) -> q`, `rms_norm(x [T, hidden], weight, eps)` and `silu_and_mul(x [T, 2 I])`
    / `gelu_tanh_and_mul(x [T, 2 I]) -> [T, I]`, bfloat16 or float32 (the KV cache also float8_e5m2 or
    int8, its rows laid out as nanoserve.model.kv_rows says),
    `dense_matmul(x, weight, bias)` (float32 x @ weight.T + bias; see nanoserve.model.layers.linear)
    and `quant_matmul(x, codes, scales, bits)` where `quant_matmul_supported()` (see
    nanoserve.model.quant); None when it cannot be built here."""
    name = library_name(cpu_identity())
    folder = build_dir() / name
    library = folder / f"{name}.so"
    try:
        spec = importlib.util.spec_from_file_location(name, library) if library.is_file() else None
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            mark_used(folder)
            return module
        from torch.utils.cpp_extension import load

        folder.mkdir(parents=True, exist_ok=True)
        logger.info("building the C++ CPU kernels (once; minutes on a small machine)")
        module = load(
            name,
            [str(source) for source in SOURCES],
            extra_cflags=build_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
        )
        prune_builds(keep=folder)
        return module
    except Exception as e:  # a missing compiler or headers: fall back, loudly once
        logger.warning("the C++ CPU kernels could not be built (%s); using PyTorch ops", e)
        return None
