"""Fixtures the unit tests share."""

from __future__ import annotations

import shutil
import subprocess

import pytest


@pytest.fixture
def bus_address():
    """A private dbus-daemon's address (packaging/setup.sh installs dbus: this
    fails rather than skips where it is missing, so CI never skips it)."""
    assert shutil.which("dbus-daemon"), "dbus-daemon is missing: packaging/setup.sh installs the dbus package"
    daemon = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield daemon.stdout.readline().strip()
    finally:
        daemon.terminate()
        daemon.wait()
