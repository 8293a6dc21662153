"""The `own_process` marker: a module's tests run in a child pytest, so a test that ends its process fails
instead of ending the whole run.

Why: Ray ends the process it runs in, with exit status 1 and no traceback, when a thread touches it while
`ray.shutdown()` tears down its core worker; in the run's own process that is a pytest that stops
mid-suite with no summary. Marked with
`pytestmark = pytest.mark.own_process`, a module instead runs in a fresh `python -m pytest` (started, not
forked: the run has torch's thread pools and ZMQ sockets), its reports are replayed here one by one, and
if the child ends early the test it was running fails with the exit status and the end of the child's
output; the tests after it run in a new child. Whatever the child leaves behind (its process group) is
killed. Marked modules run after every other test (nothing in-process follows them, so pytest's own
fixture teardown never has to step over them), each module in one child that shares its module fixtures.

The child runs the parent's selection with the configuration (pyproject.toml, PYTEST_ADDOPTS) but not
the parent's other command-line options, with `--capture=tee-sys` so that what a dying process wrote to
its file descriptors is in its output. pytest-timeout bounds each test there; the parent waits at most
for the sum of those timeouts (no bound when a test has none). `-p no:process_isolation` runs marked
tests in-process, as any others (for `--pdb`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

Phase = Literal["setup", "call", "teardown"]

MARKER = "own_process"
REPORTS_ENV = "NANOSERVE_TEST_REPORTS"
"""Set in a child: the file where it appends each test report, one JSON line each."""
CHILD_START_S = 120.0
"""What the parent allows a child beyond its tests' timeouts: interpreter start, imports, collection."""
OUTPUT_TAIL_LINES = 80
PHASES: tuple[Phase, ...] = ("setup", "call", "teardown")


def _in_child() -> bool:
    return REPORTS_ENV in os.environ


def _isolated(item: pytest.Item) -> bool:
    return not _in_child() and item.get_closest_marker(MARKER) is not None


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(REPORTS_ENV)
    if path is not None:
        config.pluginmanager.register(ReportWriter(config, Path(path)), "own-process-reports")


class ReportWriter:
    """The child's side: every test report, as a line of JSON written at once (a crash loses none)."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_isolated)  # stable: each marked module stays in order, after the rest


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item) -> bool | None:
    """The parent's timer would fire while it waits for the child; the child times each test itself."""
    return True if _isolated(item) else None


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if _isolated(item) else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> bool | None:
    if not _isolated(item):
        return None
    module = _module_runs(item.session).setdefault(item.path, ModuleRun(_marked_items(item)))
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in module.reports_of(item):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


_RUNS = pytest.StashKey[dict[Path, "ModuleRun"]]()


def _module_runs(session: pytest.Session) -> dict[Path, ModuleRun]:
    return session.stash.setdefault(_RUNS, {})


def _marked_items(item: pytest.Item) -> list[pytest.Item]:
    return [i for i in item.session.items if i.path == item.path and _isolated(i)]


@dataclass
class ChildEnd:
    """How one child pytest ended."""

    returncode: int | None
    """None: killed at the parent's deadline."""
    deadline_s: float | None
    output_tail: str


@dataclass
class ModuleRun:
    """The marked tests of one module, run in as many children as it takes (one, unless one dies)."""

    items: list[pytest.Item]
    reports: dict[str, list[pytest.TestReport]] = field(default_factory=dict)
    done: bool = False

    def reports_of(self, item: pytest.Item) -> list[pytest.TestReport]:
        if not self.done:
            self._run_all()
            self.done = True
        return self.reports[item.nodeid]

    def _run_all(self) -> None:
        pending = list(self.items)
        while pending:
            reports, end = _run_child(pending)
            pending = self._settle(pending, reports, end)

    def _settle(
        self, items: list[pytest.Item], reports: dict[str, list[pytest.TestReport]], end: ChildEnd
    ) -> list[pytest.Item]:
        """Keep what the child reported; the test it was running when it ended early fails. Returns the
        tests it never reached."""
        for index, item in enumerate(items):
            got = reports.get(item.nodeid, [])
            if not _finished(got):
                self.reports[item.nodeid] = [*got, _failure(item, _missing_phase(got), end)]
                return items[index + 1 :]
            self.reports[item.nodeid] = got
        failed = any(r.failed for item in items for r in reports[item.nodeid])
        if end.returncode != (1 if failed else 0):  # every test reported, yet the process ended badly
            last = items[-1]
            self.reports[last.nodeid] = [
                *self.reports[last.nodeid][:-1],
                _failure(last, "teardown", end),
            ]
        return []


def _finished(reports: list[pytest.TestReport]) -> bool:
    return any(r.when == "teardown" for r in reports)


def _missing_phase(reports: list[pytest.TestReport]) -> Phase:
    seen = {r.when: r for r in reports}
    if "setup" in seen and not seen["setup"].passed:
        return "teardown"
    return next(phase for phase in PHASES if phase not in seen)


def _failure(item: pytest.Item, when: Phase, end: ChildEnd) -> pytest.TestReport:
    if end.returncode is None:
        how = f"was killed after {end.deadline_s} s (its tests' timeouts, and {CHILD_START_S:.0f} s to start)"
    elif end.returncode < 0:
        how = f"was killed by {signal.Signals(-end.returncode).name}"
    else:
        how = f"ended with exit status {end.returncode}"
    text = (
        f"The child pytest running this module's tests (tests/process_isolation.py) {how} "
        f"during the {when} of {item.nodeid}, which reported no result.\n"
        f"The end of its output:\n{end.output_tail}"
    )
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords=dict.fromkeys(item.keywords, 1),
        outcome="failed",
        longrepr=text,
        when=when,
    )


def _timeout_s(item: pytest.Item) -> float | None:
    """pytest-timeout's limit for the test (its marker's, else the ini's); None when it has none."""
    marker = item.get_closest_marker("timeout")
    value = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    return float(value) if value and float(value) > 0 else None


def _deadline_s(items: list[pytest.Item]) -> float | None:
    timeouts = [_timeout_s(item) for item in items]
    return None if None in timeouts else CHILD_START_S + sum(t for t in timeouts if t is not None)


def _run_child(items: list[pytest.Item]) -> tuple[dict[str, list[pytest.TestReport]], ChildEnd]:
    """Run `items` (of one module) in a child pytest in its own process group; its reports by test."""
    config = items[0].config
    deadline_s = _deadline_s(items)
    with tempfile.TemporaryDirectory(prefix="nanoserve-own-process-") as scratch:
        reports_path, output_path = Path(scratch) / "reports.jsonl", Path(scratch) / "output.txt"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--capture=tee-sys", "-q"]
        with open(output_path, "wb") as output:
            proc = subprocess.Popen(
                [*command, *(item.nodeid for item in items)],
                cwd=config.rootpath,
                env={**os.environ, REPORTS_ENV: str(reports_path)},
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                returncode: int | None = proc.wait(deadline_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:  # whatever the child started and left (a Ray node, an engine) goes with it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reports: dict[str, list[pytest.TestReport]] = defaultdict(list)
        if reports_path.exists():
            for line in reports_path.read_text().splitlines():
                report = config.hook.pytest_report_from_serializable(config=config, data=json.loads(line))
                reports[report.nodeid].append(report)
        tail = output_path.read_text(errors="replace").splitlines()[-OUTPUT_TAIL_LINES:]
    return reports, ChildEnd(returncode, deadline_s, "\n".join(tail))
