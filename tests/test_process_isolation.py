"""The own_process marker (tests/process_isolation.py), on small suites run by a pytest of their own: a
child that ends early fails the test it was running, with its exit status and output, and the run goes
on to its summary."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

TESTS_DIR = Path(__file__).parent
RUN_TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))  # the children import the plugin too
    pytester.makeconftest('pytest_plugins = ["process_isolation"]')
    pytester.makeini("[pytest]\ntimeout = 60\nmarkers = own_process\n")
    return pytester


def run(suite: pytest.Pytester) -> pytest.RunResult:
    return suite.runpytest_subprocess("-rA", "-p", "no:cacheprovider", timeout=RUN_TIMEOUT_S)


def test_a_child_that_dies_in_module_teardown_fails_the_test_it_was_running(suite):
    suite.makepyfile(
        test_dies="""
        import os
        import pytest

        pytestmark = pytest.mark.own_process

        @pytest.fixture(scope="module")
        def resource():
            yield
            print("about to vanish", flush=True)
            os._exit(1)  # what Ray does to a driver it finds shut down

        def test_first(resource):
            pass

        def test_last(resource):
            pass
        """,
        test_plain="""
        def test_in_process():
            pass
        """,
    )
    result = run(suite)
    result.assert_outcomes(passed=3, errors=1)  # test_last passed, then its teardown never ended
    result.stdout.fnmatch_lines(
        [
            "*ended with exit status 1 during the teardown of test_dies.py::test_last*",
            "*about to vanish*",
            "ERROR test_dies.py::test_last*",
        ]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_the_tests_after_a_dead_one_run_in_a_new_child(suite):
    suite.makepyfile(
        test_mod="""
        import os
        import pytest

        pytestmark = pytest.mark.own_process

        def test_before():
            assert os.getpid() != int(os.environ["PARENT_PID"])

        def test_dies():
            os._exit(3)

        def test_fails():
            assert 1 == 2, "a plain failure keeps its message"

        def test_after():
            pass
        """
    )
    suite.makeconftest(
        'import os\npytest_plugins = ["process_isolation"]\nos.environ.setdefault("PARENT_PID", str(os.getpid()))'
    )
    result = run(suite)
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*ended with exit status 3 during the call of test_mod.py::test_dies*",
            "*a plain failure keeps its message*",
        ]
    )
    result.stdout.fnmatch_lines(["PASSED test_mod.py::test_before", "PASSED test_mod.py::test_after"])


def test_what_a_child_leaves_behind_is_killed(suite, tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    suite.makepyfile(
        test_leaves=f"""
        import os
        import subprocess
        import pytest

        pytestmark = pytest.mark.own_process

        def test_leaves_a_process():
            sleeper = subprocess.Popen(["sleep", "600"])
            open({str(pid_file)!r}, "w").write(str(sleeper.pid))
            os._exit(0)
        """
    )
    result = run(suite)
    result.assert_outcomes(failed=1)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, f"the child's sleeper {pid} outlived it"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
