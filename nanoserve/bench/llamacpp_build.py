"""How `make setup-peers` builds llama-cpp-python for this CPU, and the record `bench peers` reads back.

A native build (`-march=native`) on a CPU with AMX compiles ggml's AMX matmul, which dies with "Illegal
instruction" on `tilezero` (the tile configuration is not valid in ggml's worker threads). There the build
turns GGML_NATIVE off and sets each x86 extension ggml has an option for by what /proc/cpuinfo lists, with
the GGML_AMX_* options off; every other CPU gets the native build.

Run as a script (stdlib only: the peers venv has no nanoserve yet when llama-cpp-python is built):
`python nanoserve/bench/llamacpp_build.py --record VENV` prints the CMake arguments for CMAKE_ARGS and
writes the build's kind to VENV/llama-cpp-build.txt.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

BUILD_RECORD = "llama-cpp-build.txt"
NATIVE, NO_AMX = "native", "no-AMX build"

# ggml CMake option -> the /proc/cpuinfo flags it needs (ggml/CMakeLists.txt; GGML_AVX512 compiles with
# -mavx512f/cd/vl/dq/bw together).
GGML_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's first processor (x86's `flags : ...` line)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def build_kind(flags: Iterable[str]) -> str:
    return NO_AMX if "amx_tile" in set(flags) else NATIVE


def cmake_args(flags: Iterable[str]) -> list[str]:
    """The -D arguments for this CPU: none for a native build, every ggml x86 option spelled out without it."""
    flags = set(flags)
    if build_kind(flags) == NATIVE:
        return []
    args = ["-DGGML_NATIVE=OFF"]
    for option, needs in GGML_OPTIONS.items():
        args.append(f"-D{option}={'ON' if flags.issuperset(needs) else 'OFF'}")
    return args + [f"-D{option}=OFF" for option in AMX_OPTIONS]


def recorded_kind(venv: Path) -> str:
    """The kind `--record` wrote; venvs built before the record existed only ever had native builds."""
    record = venv / BUILD_RECORD
    return record.read_text().strip() if record.is_file() else NATIVE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpuinfo", default="/proc/cpuinfo", help="read the CPU's flags from this file")
    parser.add_argument(
        "--record", type=Path, default=None, metavar="VENV", help=f"write VENV/{BUILD_RECORD}"
    )
    args = parser.parse_args(argv)
    cpuinfo = Path(args.cpuinfo)
    flags = cpu_flags(cpuinfo.read_text()) if cpuinfo.is_file() else set()
    if args.record is not None:
        (args.record / BUILD_RECORD).write_text(build_kind(flags) + "\n")
    print(" ".join(cmake_args(flags)))


if __name__ == "__main__":
    main()
