"""Each tier's time at the end of a run: `.ci/run` runs every tier in one
pytest session, and CI's report asks for each tier's time."""

from __future__ import annotations

import collections

_seconds: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report) -> None:
    # tests/<tier>/...: setup, call and teardown, fixtures (a container's boot) included
    parts = report.nodeid.split("/")
    _seconds[parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if _seconds:
        terminalreporter.write_sep("-", "seconds per tier (setup, call and teardown of its tests)")
        for tier, seconds in sorted(_seconds.items()):
            terminalreporter.write_line(f"{tier}: {seconds:.0f} s")
