"""packaging/cockpit/hostd.js run in node (tests/unit/cockpit_harness.js:
stand-ins for the browser and cockpit.js), for what it hands the host's
commands. The page in a real browser against a real host is
tests/system/test_cockpit.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[1] / "packaging/cockpit/hostd.js"


def node() -> str:
    """Debian's node, or the one Playwright (the test extra) carries."""
    try:
        import playwright
        bundled = Path(playwright.__file__).parent / "driver" / "node"
    except ImportError:
        bundled = None
    found = shutil.which("node") or (str(bundled) if bundled and bundled.is_file() else None)
    if found is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("CI=true but no node: pip install -e '.[test]' (Playwright carries one)")
        pytest.skip("no node to run the page with")
    return found


def spawned_for(name: str) -> list[list[str]]:
    """Every argv the page spawns when the URL opens model NAME (#/NAME)."""
    done = subprocess.run([node(), str(HERE / "cockpit_harness.js"), str(PAGE), name],
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_name_from_the_url_reaches_hostctl_as_a_name_never_an_option():
    """#/--config-dir=/tmp/x would have `hostctl config` read another
    configuration root (and print it as this host's): after `--`, it is only
    a model name hostctl refuses."""
    name = "--config-dir=/tmp/x"
    spawned = spawned_for(name)
    hostctl = [argv for argv in spawned if argv[0] == "hostctl"]
    assert {argv[1] for argv in hostctl} >= {"config", "logs"}, spawned
    for argv in spawned:
        assert argv[-2:] == ["--", name], argv


def test_the_journal_pane_reads_hostctl_logs_not_the_forgeable_field_alone():
    """HOSTD_MODEL= alone is a field any local user can write into the
    journal; `hostctl logs` also matches the model's units (_SYSTEMD_UNIT=)."""
    spawned = spawned_for("tiny")
    assert not [argv for argv in spawned if argv[0] == "journalctl"], spawned
    assert ["hostctl", "logs", "--follow", "--lines=200", "--json=short", "--", "tiny"] in spawned, spawned
