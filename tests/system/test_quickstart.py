"""docs/quickstart.md, typed literally, on a fresh host: the page cannot drift
from the product.

The test extracts the page's shell blocks and runs them in order, as root, in
a fresh systemd-nspawn container (systemd 252 as PID 1), with hostd installed
from a wheel built from the checkout. Two substitutions only, both stated
here: the wheel's path for `/path/to/hostd-checkout`, and, when port 8000 is
taken on this machine (the container shares its network), a port held for the run.

Then, in the same container, the page's other install: the same wheel without
the `builtin` extra (a vLLM or SGLang host's), into a second environment,
where `import torch` fails, a vllm model passes `hostctl config --check` and a
builtin model is refused naming `pip install 'hostd[builtin]'`.

pip in the container finds packages as this machine's pip does: its
configuration, local wheel directories, CA certificates and download cache are
bound in (read-only, except the cache).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import CHECKOUT
from container import Bind
from ports import reserve, reserved_port

QUICKSTART = CHECKOUT / "docs" / "quickstart.md"
PLACEHOLDER = "/path/to/hostd-checkout"
# Host paths that make pip work inside as it does here, where present.
PIP_PATHS = ("/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more", "/etc/ssl")


def shell_blocks(markdown: str) -> list[str]:
    """The page's fenced blocks without a language (the page's shell blocks)."""
    return re.findall(r"^```\n(.*?)^```$", markdown, flags=re.S | re.M)


def build_wheel(out: Path) -> Path:
    """A wheel of the checkout as it is now, built from a copy (no build/ left behind)."""
    source = out / "source"
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(CHECKOUT, source, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out / "wheel"), str(source)], check=True, capture_output=True, text=True)
    [wheel] = (out / "wheel").glob("hostd-*.whl")
    return wheel


def pip_inside() -> tuple[list[Bind], dict[str, str]]:
    """The binds and the environment with which pip in a container finds
    packages as this machine's pip does (the module docstring's last paragraph)."""
    binds = [Bind(Path(p), Path(p)) for p in PIP_PATHS if Path(p).exists()]
    pip_cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
    pip_cache.mkdir(parents=True, exist_ok=True)
    binds.append(Bind(pip_cache, Path("/var/cache/pip"), readonly=False))
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    env["PIP_CACHE_DIR"] = "/var/cache/pip"
    return binds, env


def test_quickstart_page_runs_as_written_in_a_fresh_container(make_systemd_container, tmp_path: Path):
    started = time.monotonic()
    wheel = build_wheel(tmp_path)
    blocks = shell_blocks(QUICKSTART.read_text())
    assert len(blocks) >= 5 and any("hostd install" in b for b in blocks)
    script = [b.replace(PLACEHOLDER, f"/wheels/{wheel.name}") for b in blocks]
    if not reserve(8000):  # held for the run (ports.py), or another held port
        script = [b.replace("127.0.0.1:8000", f"127.0.0.1:{reserved_port()}") for b in script]

    pip_binds, env = pip_inside()
    container = make_systemd_container(binds=[Bind(wheel.parent, Path("/wheels")), *pip_binds])

    outputs = []
    for number, block in enumerate(script, 1):
        result = container.run(["bash", "-e", "-x", "-c", block], check=False, timeout=900, env=env)
        outputs.append(f"--- block {number} (exit {result.returncode})\n{result.stdout}{result.stderr}")
        if result.returncode != 0:
            journal = container.run(["journalctl", "--no-pager", "-n", "60", "-o", "short-monotonic"], check=False)
            outputs.append(f"--- the journal's last lines\n{journal.stdout}")
        assert result.returncode == 0, "\n".join(outputs)[-12000:]
    text = "\n".join(outputs)
    print(f"quickstart ran in {time.monotonic() - started:.0f} s (wheel build and boot included)")

    # What the page promises along the way.
    assert '"choices"' in text  # the curl completion
    assert "Active: active (running)" in text
    assert container.run(["sh", "-c", "command -v hostd; command -v hostctl"]).stdout.split() == [
        "/usr/local/bin/hostd", "/usr/local/bin/hostctl"]
    assert container.run(["systemctl", "is-active", "hostd.service"]).stdout.strip() == "active"  # activated
    assert "max_num_seqs: 8" in container.run(["hostctl", "config", "tiny"]).stdout

    # The install without the builtin extra: pip's cache already holds every
    # wheel it needs (the page's install fetched them), so this takes seconds.
    lean = container.run(["bash", "-e", "-c", f"""
        python3 -m venv /opt/hostd-lean
        /opt/hostd-lean/bin/pip install -q /wheels/{wheel.name}
        mkdir -p /tmp/lean/models
        printf 'backend: vllm\\nmodel: /var/lib/hostd/checkpoints/tiny\\nlisten: 127.0.0.1:18002\\n' \\
            > /tmp/lean/models/lean-vllm.yaml
        /opt/hostd-lean/bin/hostctl --config-dir /tmp/lean config --check
        printf 'backend: builtin\\nmodel: /var/lib/hostd/checkpoints/tiny\\nlisten: 127.0.0.1:18003\\n' \\
            > /tmp/lean/models/lean-builtin.yaml
        if /opt/hostd-lean/bin/hostctl --config-dir /tmp/lean config --check; then exit 1; fi
        if /opt/hostd-lean/bin/python -c 'import torch'; then exit 1; fi
    """], check=False, timeout=600, env=env)
    assert lean.returncode == 0, lean.stdout + lean.stderr
    assert "No module named 'torch'" in lean.stderr, lean.stderr
    assert "lean-vllm.yaml" not in lean.stdout + lean.stderr
    # hostctl config --check writes its problems to stderr.
    assert "lean-builtin.yaml" in lean.stderr and "-m pip install 'hostd[builtin]'" in lean.stderr, lean.stderr
