"""What the GPU tier carries meets the project's own pins (issue 31): the
transformers wheel packaging/fetch-gpu-tier.sh fetches is inside
pyproject.toml's specifier, and packaging/check-requirements.py, which
run-gpu-tier.sh runs before it boots anything, passes here and names the
package, the version found and the one needed when a pin is not met."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["builtin"]  # transformers: the extra
    return {Requirement(d).name: Requirement(d) for d in lines}


def test_every_carried_wheel_of_a_dependency_is_inside_its_pin():
    carried = dict(re.findall(r"^\s+([A-Za-z0-9_.-]+)==([0-9][^\s]*)", (ROOT / "packaging/fetch-gpu-tier.sh").read_text(),
                              re.M))
    assert "transformers" in carried  # the GPU image's 5.17 is outside the pin
    for name, version in carried.items():
        if name in pins():
            assert pins()[name].specifier.contains(version), (name, version, str(pins()[name]))


def test_check_requirements_passes_here_and_names_what_is_not_met(tmp_path: Path):
    script = ROOT / "packaging/check-requirements.py"
    ok = subprocess.run([sys.executable, str(script), "--extra", "builtin", "--extra", "test"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    # A copy of the script beside a pyproject that pins what is not installed.
    (tmp_path / "packaging").mkdir()
    (tmp_path / "packaging/check-requirements.py").write_text(script.read_text())
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\nversion = "0"\ndependencies = ["msgspec<0.1", "no-such-package-hostd>=1"]\n'
        '[project.optional-dependencies]\ntest = []\n')
    bad = subprocess.run([sys.executable, str(tmp_path / "packaging/check-requirements.py")], capture_output=True,
                         text=True)
    assert bad.returncode == 1
    import msgspec

    assert f"msgspec: {msgspec.__version__} installed, hostd needs msgspec<0.1" in bad.stderr, bad.stderr
    assert "no-such-package-hostd: not installed, hostd needs no-such-package-hostd>=1" in bad.stderr
