"""hostd install / hostd uninstall: put hostd's system integration in place.

One job: copy the unit templates (with this installation's Python, user and
paths substituted), the generator, the sysusers.d and tmpfiles.d entries, the
D-Bus policy and an example config into the system, and take them away again.
Works for a virtual environment and for a system prefix alike: the units run
`<this python> -m hostd.main`, whichever Python that is.

Every file written is listed in /var/lib/hostd/installed-files so that
uninstall removes exactly those. Configuration under /etc/hostd is created
only when absent and is left in place by uninstall unless --purge.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hostd.config.atomic import write_atomic

USER = "hostd"
MANIFEST = "installed-files"


def data_dir(name: str) -> Path:
    """units/ or packaging/: from the checkout, else from the wheel's share/."""
    checkout = Path(__file__).resolve().parents[1] / name
    if checkout.is_dir():
        return checkout
    shared = Path(sys.prefix) / "share" / "hostd" / name
    if shared.is_dir():
        return shared
    raise FileNotFoundError(f"hostd's {name}/ directory is neither in the checkout nor in {shared}")


def docs_dir() -> str:
    checkout = Path(__file__).resolve().parents[1] / "docs"
    return str(checkout if checkout.is_dir() else Path(sys.prefix) / "share" / "doc" / "hostd")


def render_units(python: str, config_dir: str) -> dict[str, str]:
    """Unit file name -> text, placeholders substituted."""
    hardening = (data_dir("packaging") / "hardening.conf").read_text().rstrip("\n")
    values = {
        "@HARDENING@": hardening,  # first: it contains placeholders itself
        "@PYTHON@": python,
        "@USER@": USER,
        "@DOCDIR@": docs_dir(),
        "@CONFDIR@": config_dir,
    }
    install_paths = (python, str(Path(__file__).resolve().parent))
    if any(p.startswith(("/tmp/", "/var/tmp/")) for p in install_paths):
        # A private /tmp would hide this installation from the services.
        # /tmp stays read-only (ProtectSystem=strict): temporary files go to
        # the unit's own cache directory instead.
        values["@HARDENING@"] = hardening.replace(
            "PrivateTmp=yes",
            "# PrivateTmp= off: hostd is installed under /tmp\nPrivateTmp=no\nEnvironment=TMPDIR=%C/hostd/%i")
    units = {}
    for path in sorted(data_dir("units").iterdir()):
        text = path.read_text()
        for key, value in values.items():
            text = text.replace(key, value)
        if "@HARDENING@" not in path.read_text() and values["@HARDENING@"] != hardening:
            # The manager's own sandbox (hostd.service) has the same conflict.
            text = text.replace("PrivateTmp=yes", "# PrivateTmp= off: hostd is installed under /tmp\nPrivateTmp=no")
        units[path.name] = text
    return units


def generator_script(python: str, config_dir: str, unit_dir: str) -> str:
    return (
        "#!/bin/sh\n"
        "# hostd-generator: /etc/hostd/models/*.yaml -> unit drop-ins (see hostd/generator.py)\n"
        f"HOSTD_CONFIG_DIR={config_dir} HOSTD_UNIT_DIR={unit_dir} exec {python} -m hostd.generator \"$@\"\n"
    )


def planned_files(args: argparse.Namespace) -> dict[Path, tuple[str, int]]:
    """Destination -> (content, mode) of every file install writes."""
    root = Path(args.root)
    python = args.python or sys.executable
    packaging = data_dir("packaging")
    files: dict[Path, tuple[str, int]] = {}
    for name, text in render_units(python, args.config_dir).items():
        files[root / args.unit_dir.lstrip("/") / name] = (text, 0o644)
    files[root / args.generator_dir.lstrip("/") / "hostd-generator"] = (
        generator_script(python, args.config_dir, args.unit_dir), 0o755)
    files[root / "etc/sysusers.d/hostd.conf"] = ((packaging / "sysusers.conf").read_text(), 0o644)
    files[root / "etc/tmpfiles.d/hostd.conf"] = ((packaging / "tmpfiles.conf").read_text(), 0o644)
    files[root / "etc/dbus-1/system.d/org.hostd1.conf"] = ((packaging / "org.hostd1.conf").read_text(), 0o644)
    return files


def systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir()


def run_tool(*argv: str) -> None:
    if shutil.which(argv[0]) is None:
        print(f"hostd install: {argv[0]} not found; skipped", file=sys.stderr)
        return
    subprocess.run(argv, check=True)


def install(args: argparse.Namespace) -> int:
    root = Path(args.root)
    files = planned_files(args)
    for path, (text, mode) in files.items():
        write_atomic(path, text, mode=mode)
        print(f"installed {path}")
    config = root / args.config_dir.lstrip("/")
    (config / "models").mkdir(parents=True, exist_ok=True)
    example = data_dir("packaging").parent / "etc" / "hostd.yaml"
    if not (config / "hostd.yaml").exists() and example.is_file():
        write_atomic(config / "hostd.yaml", example.read_text())
        files[config / "hostd.yaml"] = ("", 0)
        print(f"installed {config / 'hostd.yaml'} (example)")
    state = root / "var/lib/hostd"
    state.mkdir(parents=True, exist_ok=True)
    write_atomic(state / MANIFEST, "".join(f"{p}\n" for p in files))
    if args.root == "/":
        run_tool("systemd-sysusers", str(root / "etc/sysusers.d/hostd.conf"))
        run_tool("systemd-tmpfiles", "--create", str(root / "etc/tmpfiles.d/hostd.conf"))
        if systemd_running() and not args.no_reload:
            run_tool("systemctl", "daemon-reload")
            run_tool("systemctl", "try-reload-or-restart", "dbus.service")
    return 0


def uninstall(args: argparse.Namespace) -> int:
    root = Path(args.root)
    manifest = root / "var/lib/hostd" / MANIFEST
    listed = manifest.read_text().split() if manifest.exists() else [str(p) for p in planned_files(args)]
    for name in listed:
        path = Path(name)
        if path.parent == root / args.config_dir.lstrip("/") and not args.purge:
            continue
        if path.exists():
            path.unlink()
            print(f"removed {path}")
    manifest.unlink(missing_ok=True)
    if args.purge:
        shutil.rmtree(root / args.config_dir.lstrip("/"), ignore_errors=True)
        print(f"removed {root / args.config_dir.lstrip('/')}")
    if args.root == "/" and systemd_running() and not args.no_reload:
        run_tool("systemctl", "daemon-reload")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="install below this directory (packaging, tests)")
    parser.add_argument("--unit-dir", default="/etc/systemd/system")
    parser.add_argument("--generator-dir", default="/etc/systemd/system-generators")
    parser.add_argument("--python", help="interpreter the units run (default: this one)")
    parser.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    parser.add_argument("--purge", action="store_true", help="uninstall: also remove /etc/hostd")


def run(args: argparse.Namespace) -> int:
    args.config_dir = str(args.config_dir or "/etc/hostd")
    return uninstall(args) if args.command == "uninstall" else install(args)
