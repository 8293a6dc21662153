"""Which stand-ins `make test-cpus` runs on which CPU (tests/other_cpus.py)."""

from __future__ import annotations

from nanoserve.model.loader import native_bf16
from tests.other_cpus import AVX2, AVX512, STAND_INS, applicable

ZEN3 = AVX2
ZEN4 = AVX2 | AVX512 | {"avx512_vnni", "avx512_bf16"}
AMX_XEON = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def run_on(flags: set[str]) -> list[str]:
    return [stand_in.arch for stand_in in STAND_INS if applicable(stand_in, flags)]


def test_each_cpu_stands_in_for_the_older_ones_it_runs_the_code_of():
    assert run_on(ZEN3) == []  # its own run is the AVX2 one
    assert run_on(ZEN4) == ["x86-64-v3", "skylake-avx512", "cascadelake"]
    assert run_on(AMX_XEON) == ["x86-64-v3", "skylake-avx512", "cascadelake", "cooperlake"]
    # Cascade Lake: no bf16 to drop
    assert run_on(AVX512 | AVX2 | {"avx512_vnni"}) == ["x86-64-v3", "skylake-avx512"]
    assert run_on(AVX512 | AVX2) == ["x86-64-v3"]  # Skylake-X: its own run is the one without VNNI


def test_each_stand_in_gets_the_dtype_auto_of_the_cpus_it_stands_for():
    """Under a stand-in's oneDNN cap the engine's dtype auto is that CPU's: float32 without native bf16."""
    flags = " ".join(sorted(AMX_XEON))
    native = {s.arch: native_bf16(flags, s.aten_capability.upper(), s.onednn_isa) for s in STAND_INS}
    assert native == {"x86-64-v3": False, "skylake-avx512": False, "cascadelake": False, "cooperlake": True}
