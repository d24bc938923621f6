"""Every service hostd installs is sandboxed: `systemd-analyze security`
rates each one "OK" (3.0 or lower), the root manager included (issue 12, row 10).
Run offline on the rendered unit files, as `hostd install` writes them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hostd import install


def exposure(unit_file: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit_file)],
        capture_output=True, text=True, timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout + result.stderr)
    assert match, result.stdout + result.stderr
    return float(match.group(1))


def test_every_installed_service_is_rated_ok(tmp_path: Path):
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("CI=true but systemd-analyze is missing (apt-get install systemd)")
        pytest.skip("systemd-analyze is not installed")
    scores = {}
    for name, text in install.render_units("/usr/bin/python3", "/etc/hostd").items():
        if not name.endswith(".service"):
            continue
        path = tmp_path / name.replace("@.", "@tiny.")  # templates need an instance
        path.write_text(text)
        scores[path.name] = exposure(path)
    assert set(scores) == {"hostd.service", "model@tiny.service", "model-engine@tiny.service",
                           "model-engine-next@tiny.service", "model-engine-standby@tiny.service",
                           "model-engine-swap@tiny.service", "model-engine-spare@tiny.service", "model-weights@tiny.service",
                           "model-weights-next@tiny.service"}
    assert all(score <= 3.0 for score in scores.values()), scores


def test_every_model_service_tags_its_journal_lines_with_the_model():
    """`hostctl logs` and the Cockpit page select a model's lines by
    HOSTD_MODEL= and the model's units: a unit without LogExtraFields= (the
    standby once) has its upstream stderr and crash lines left out."""
    services = {name: text for name, text in install.render_units("/usr/bin/python3", "/etc/hostd").items()
                if name.startswith("model") and name.endswith(".service")}
    assert "model-engine-standby@.service" in services
    untagged = [name for name, text in services.items() if "\nLogExtraFields=HOSTD_MODEL=%i\n" not in text]
    assert untagged == []
