"""The kernel tests again, once for each older x86 CPU that this one can stand in for.

The C++ kernels choose their code paths when they are compiled (`-march`), oneDNN and ATen choose theirs
when they run. A machine with AMX would otherwise only ever test its own paths, and the AVX2 path (AMD
Zen 1-3) or the AVX-512 path without AMX (Zen 4 and 5) would first run on a user's machine. A stand-in
builds the kernels for an older target (NANOSERVE_KERNEL_ARCH) and caps oneDNN (ONEDNN_MAX_CPU_ISA) and
ATen (ATEN_CPU_CAPABILITY) at the same instructions, then runs the tests of the model's kernels.

    python -m tests.other_cpus [pytest options]

`make test-cpus` runs it (CI does, after `make test`). A stand-in runs only where this CPU has every
instruction set it needs and one that it lacks (otherwise this CPU's own run has tested those paths).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nanoserve import envs
from nanoserve.model.kernels import cpu_fields

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = [
    "tests/model/test_cpu_kernels.py",
    "tests/model/test_quant.py",
    "tests/model/test_dense_matmul.py",
    "tests/model/test_flash_prefill.py",
    "tests/model/test_fused_decoder.py",
    "tests/model/test_kv_cache_dtype.py",
    "tests/model/test_sampler.py",
]
"""Every C++ kernel against its PyTorch reference, and the fused steps against the module path."""
DESELECT = "not bundled_model"
"""The bundled model's tests run the kernels the tiny families run, on larger weights: minutes under a
stand-in without native bf16, so they are left to each CPU's own run."""
BUILD = "import sys; from nanoserve.model.kernels import cpu_kernels; sys.exit(cpu_kernels() is None)"
"""Built ahead (minutes), outside the tests' time limits; a failed build fails the stand-in."""
TIMEOUT_S = 1800
"""For the build, and for the tests: each takes one or two minutes on 2 cores."""


@dataclass(frozen=True)
class StandIn:
    cpus: str
    arch: str
    """GCC's -march for the kernels."""
    onednn_isa: str
    aten_capability: str
    needs: frozenset[str]
    """/proc/cpuinfo flags the target's code uses."""
    lacks: str
    """A flag of this CPU that the stand-in goes without: where this CPU lacks it too, its own run tested
    these paths."""

    def environment(self) -> dict[str, str]:
        return {
            envs.KERNEL_ARCH: self.arch,
            "ONEDNN_MAX_CPU_ISA": self.onednn_isa,
            "ATEN_CPU_CAPABILITY": self.aten_capability,
        }


AVX2 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
STAND_INS = (
    StandIn(
        "AVX2 and FMA (AMD Zen 1-3, Intel Haswell to Comet Lake)",
        "x86-64-v3",
        "AVX2",
        "avx2",
        AVX2,
        lacks="avx512f",
    ),
    StandIn(
        "AVX-512 without VNNI (Intel Skylake-SP and -X): AVX-512 attention beside the AVX2 quantized matmul",
        "skylake-avx512",
        "AVX512_CORE",
        "avx512",
        AVX512,
        lacks="avx512_vnni",
    ),
    StandIn(
        "AVX-512 with VNNI, no BF16 (Intel Cascade Lake, Ice Lake)",
        "cascadelake",
        "AVX512_CORE_VNNI",
        "avx512",
        AVX512 | {"avx512_vnni"},
        lacks="avx512_bf16",
    ),
    StandIn(
        "AVX-512 with VNNI and BF16, no AMX (AMD Zen 4 and 5, Intel Cooper Lake)",
        "cooperlake",
        "AVX512_CORE_BF16",
        "avx512",
        AVX512 | {"avx512_vnni", "avx512_bf16"},
        lacks="amx_tile",
    ),
)


def applicable(stand_in: StandIn, flags: set[str]) -> bool:
    return stand_in.needs <= flags and stand_in.lacks in flags


def run(command: list[str], env: dict[str, str]) -> int:
    """The command's exit status; past TIMEOUT_S its whole process group (compilers included) is killed."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        return process.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"other CPUs: {command[1:3]} ran past {TIMEOUT_S} s; killed", file=sys.stderr)
        return -1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def main(pytest_args: list[str]) -> int:
    flags = set(cpu_fields().get("flags", "").split())
    failed = []
    for stand_in in STAND_INS:
        if not applicable(stand_in, flags):
            print(f"other CPUs: skipping {stand_in.cpus} (this CPU's own run covers it, or cannot run it)")
            continue
        print(f"other CPUs: {stand_in.cpus}: kernels for -march={stand_in.arch}", flush=True)
        env = {**os.environ, **stand_in.environment()}
        if run([sys.executable, "-c", BUILD], env) != 0:
            failed.append(f"{stand_in.cpus} (the kernels did not build: every kernel test would skip)")
            continue
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", DESELECT, *pytest_args]
        if run(command + KERNEL_TESTS, env) != 0:
            failed.append(stand_in.cpus)
    if failed:
        print("other CPUs: tests FAILED for " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
