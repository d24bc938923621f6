"""Each tier's time at the end of a run, and the suite's time guard: `.ci/run`
runs every tier in one pytest session, and CI's report asks for each
tier's time.

The guard (issue 54): when the whole run passes HOSTD_SUITE_LIMIT_S seconds
(70 minutes unless set; counted from HOSTD_RUN_STARTED, the epoch second
packaging/run-tests.sh wrote before its setup, else from pytest's start),
the run fails with one line naming the slowest modules, so that a slow
addition is seen when it lands and not when CI stops at 90 minutes."""

from __future__ import annotations

import collections
import os
import time

import pytest

SUITE_LIMIT_S = 70 * 60

_seconds: collections.Counter = collections.Counter()
_modules: collections.Counter = collections.Counter()
_started = time.time()
_guard: list[str] = []


def pytest_runtest_logreport(report) -> None:
    # tests/<tier>/...: setup, call and teardown, fixtures (a container's boot) included
    parts = report.nodeid.split("/")
    _seconds[parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"] += report.duration
    _modules[report.nodeid.split("::")[0]] += report.duration


def over_the_limit(now: float) -> str:
    """The guard's line when the run has taken more than its limit, else ""."""
    limit = float(os.environ.get("HOSTD_SUITE_LIMIT_S") or SUITE_LIMIT_S)
    started = float(os.environ.get("HOSTD_RUN_STARTED") or _started)
    took = now - started
    if took <= limit:
        return ""
    slowest = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in _modules.most_common(5))
    return (f"the whole run took {took / 60:.1f} min, past the suite's limit of {limit / 60:.1f} min "
            f"(HOSTD_SUITE_LIMIT_S, tests/conftest.py); the slowest modules: {slowest}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    line = over_the_limit(time.time())
    if line:
        _guard.append(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _seconds:
        terminalreporter.write_sep("-", "seconds per tier (setup, call and teardown of its tests)")
        for tier, seconds in sorted(_seconds.items()):
            terminalreporter.write_line(f"{tier}: {seconds:.0f} s")
    for line in _guard:
        terminalreporter.write_sep("!", "suite time guard")
        terminalreporter.write_line(f"FAILED: {line}", red=True)
