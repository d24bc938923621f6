"""hostd install / hostd uninstall: put hostd's system integration in place.

One job: copy the unit templates (with this installation's Python, user and
paths substituted), the generator, the sysusers.d and tmpfiles.d entries, the
D-Bus policy and activation file, the polkit actions and rules (where Debian's
polkitd reads them; the rules name hostd.yaml's admin_group), man pages, bash
completion, the Cockpit page and an example config into the
system, and take them away again.
Works for a virtual environment and for a system prefix alike: the units run
`<this python> -m hostd.main`, whichever Python that is; links in
/usr/local/bin put `hostd` and `hostctl` on root's PATH. Data files come from
the checkout (source tree, editable install) or from <prefix>/share/hostd,
where a wheel installs them.

The units run that code as root (the manager, the generator, ExecStartPre=+):
whoever can write the interpreter, the hostd package or a directory above
either can run code as root. So install refuses, writing nothing, when any of
them is writable by a group or by every user (a directory above with the
sticky bit, as /tmp, excepted), and warns loudly when one is owned by another
user than root (an editable install from a user's checkout makes that user
root's equal); check_code_location says which and how to fix it.

Every file written is listed in /var/lib/hostd/installed-files so that
uninstall removes exactly those. Configuration under /etc/hostd is created
only when absent and is left in place by uninstall unless --purge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable

from hostd.config.atomic import write_atomic

USER = "hostd"
MANIFEST = "installed-files"
CHECKOUT = Path(__file__).resolve().parents[1]

# Where each vendor file goes: the directories systemd 252, systemd-sysusers,
# systemd-tmpfiles and dbus-daemon 1.14 on Debian 12 read vendor files from
# (checked in the system-test container), so /etc stays the administrator's
# for overrides. file-hierarchy(7) puts a local installation under /usr/local;
# dbus-daemon reads bus policy only from /usr/share/dbus-1/system.d and
# /etc/dbus-1/system.d, so the policy goes to the former.
SYSUSERS = "usr/local/lib/sysusers.d/hostd.conf"
TMPFILES = "usr/local/lib/tmpfiles.d/hostd.conf"
DBUS_POLICY = "usr/share/dbus-1/system.d/org.hostd1.conf"
DBUS_ACTIVATION = "usr/local/share/dbus-1/system-services/org.hostd1.service"
COMMANDS = ("hostd", "hostctl")
# man-db reads /usr/local/share/man (manpath.config maps /usr/local/bin there);
# bash-completion loads completions/<command> from $XDG_DATA_DIRS, which
# starts with /usr/local/share.
MAN_DIR = "usr/local/share/man"
COMPLETION_DIR = "usr/local/share/bash-completion/completions"
# cockpit-bridge reads packages from $XDG_DATA_DIRS/cockpit, /usr/local/share
# first (cockpit(1) "Packages"): the page of docs/cockpit.md, from
# packaging/cockpit/.
COCKPIT_DIR = "usr/local/share/cockpit/hostd"


def in_checkout() -> bool:
    """Is this hostd the checkout's (a run from the source tree or an editable
    install)? An installed wheel's parent directory is site-packages, which may
    well hold a `packaging` directory of its own (the PyPI library)."""
    return (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "units" / "model@.service").is_file()


def data_dir(name: str) -> Path:
    """units/, packaging/ or etc/: from the checkout, else from the wheel's
    data files under <prefix>/share/hostd."""
    if in_checkout():
        return CHECKOUT / name
    shared = Path(sys.prefix) / "share" / "hostd" / name
    if shared.is_dir():
        return shared
    raise FileNotFoundError(f"hostd's {name}/ directory is neither in a checkout nor in {shared}: reinstall hostd")


def docs_dir() -> str:
    return str(CHECKOUT / "docs" if in_checkout() else Path(sys.prefix) / "share" / "doc" / "hostd")


def scripts_dir() -> Path:
    """Where pip put the `hostd` and `hostctl` commands of this installation."""
    return Path(sysconfig.get_path("scripts"))


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


POLKIT_ACTIONS = "usr/share/polkit-1/actions"  # polkitd reads actions from here only
POLKIT_RULES = "usr/share/polkit-1/rules.d"  # and rules from here and /etc/polkit-1/rules.d


def polkit_rules(config_dir: Path) -> str:
    """packaging/org.hostd1.rules for the admin group hostd.yaml names (the
    default when it cannot be read), as a JavaScript string literal."""
    from hostd import config

    try:
        group = config.load_daemon(config_dir).admin_group
    except config.ConfigError:
        group = config.schema.DaemonConfig().admin_group
    return (data_dir("packaging") / "org.hostd1.rules").read_text().replace("@ADMIN_GROUP@", json.dumps(group))


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
    files[root / SYSUSERS] = ((packaging / "sysusers.conf").read_text(), 0o644)
    files[root / TMPFILES] = ((packaging / "tmpfiles.conf").read_text(), 0o644)
    files[root / DBUS_POLICY] = ((packaging / "org.hostd1.conf").read_text(), 0o644)
    files[root / DBUS_ACTIVATION] = ((packaging / "org.hostd1.service").read_text(), 0o644)
    files[root / POLKIT_ACTIONS / "org.hostd1.policy"] = ((packaging / "org.hostd1.policy").read_text(), 0o644)
    files[root / POLKIT_RULES / "org.hostd1.rules"] = (polkit_rules(root / args.config_dir.lstrip("/")), 0o644)
    for page_file in sorted((packaging / "cockpit").iterdir()):
        files[root / COCKPIT_DIR / page_file.name] = (page_file.read_text(), 0o644)
    from hostd import manpages

    for rel, page in manpages.pages().items():
        files[root / MAN_DIR / rel] = (page, 0o644)
    for command, script in manpages.completions().items():
        files[root / COMPLETION_DIR / command] = (script, 0o644)
    return files


def planned_links(args: argparse.Namespace) -> dict[Path, Path]:
    """Link -> target: `hostd` and `hostctl` on root's PATH."""
    links = {}
    for command in COMMANDS:
        target = scripts_dir() / command
        if target.is_file():
            links[Path(args.root) / args.bin_dir.lstrip("/") / command] = target
    return links


def place_link(link: Path, target: Path) -> bool:
    """Point LINK at TARGET; never replaces a file that is not a link."""
    if link.exists() and not link.is_symlink():
        print(f"hostd install: {link} exists and is not a link; left alone", file=sys.stderr)
        return False
    link.parent.mkdir(parents=True, exist_ok=True)
    temporary = link.with_name(f".{link.name}.hostd-tmp")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)
    return True


def systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir()


def run_tool(*argv: str) -> None:
    if shutil.which(argv[0]) is None:
        print(f"hostd install: {argv[0]} not found; skipped", file=sys.stderr)
        return
    subprocess.run(argv, check=True)


def _ancestors(path: Path) -> list[Path]:
    return list(path.parents)


def _code_paths(python: str) -> list[tuple[Path, bool]]:
    """(path, is_ancestor) of what root's units run: the interpreter (as named
    and resolved) when it exists here, and, when it is this one, the hostd
    package it imports (every file in it) and the directories other packages
    come from, each with every directory above it."""
    paths: list[tuple[Path, bool]] = []
    named = Path(python).absolute()
    if named.exists():
        paths += [(named, False), (named.resolve(), False)]
        paths += [(d, True) for d in _ancestors(named) + _ancestors(named.resolve())]
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return paths  # another interpreter (--python): its packages are not known here
    package = Path(__file__).resolve().parent
    paths.append((package, False))
    for directory, dirs, files in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        paths += [(Path(directory, name), False) for name in dirs + files]
    paths += [(d, True) for d in _ancestors(package)]
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_path(key)).resolve()
        if site.is_dir():
            paths += [(site, False)] + [(d, True) for d in _ancestors(site)]
    return paths


def _account(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_code_location(python: str) -> tuple[list[str], list[str]]:
    """(refusals, warnings) about the code root's units would run: a path
    writable by a group or every user is refused (a directory above with the
    sticky bit excepted: others cannot rename its entries), one owned by a
    user other than root is warned about, one line per owner."""
    refusals: list[str] = []
    owned_by: dict[int, list[Path]] = {}
    seen: set[Path] = set()
    for path, is_ancestor in _code_paths(python):
        if path in seen:
            continue
        seen.add(path)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue  # a link's own mode means nothing; its target is on the list
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and not (is_ancestor and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
            who = "every user" if st.st_mode & stat.S_IWOTH else f"the members of group {_group(st.st_gid)}"
            refusals.append(
                f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): root's units run the code "
                f"there, so they could run anything as root; chmod go-w {path}, or install hostd where only root "
                f"can write (a virtual environment made by root, e.g. /opt/hostd)")
        if st.st_uid != 0:
            owned_by.setdefault(st.st_uid, []).append(path)
    warnings = []
    for uid, paths in owned_by.items():
        more = f" and {len(paths) - 1} more under it" if len(paths) > 1 else ""
        warnings.append(
            f"WARNING: {paths[0]}{more} owned by {_account(uid)}, not root: root's units run this code, so "
            f"{_account(uid)} can run anything as root. An editable install from a user's checkout does this; "
            f"install hostd as root into a root-owned virtual environment (docs/operations.md)")
    return refusals, warnings


def _group(gid: int) -> str:
    import grp

    try:
        return f"{grp.getgrgid(gid).gr_name!r}"
    except KeyError:
        return f"gid {gid}"


def file_change(path: Path, text: str, mode: int) -> str:
    """What writing TEXT with MODE to PATH changes: "installed" (new),
    "updated" (other content or mode) or "unchanged". Unchanged only for a
    regular file (not a symlink: it is not followed) owned by the user
    install runs as (root, for a real install) with MODE and TEXT: a link
    someone planted, or a file of theirs with the right content, stays
    theirs to change after install, under units root runs; it is replaced."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "installed"
    except OSError:
        return "updated"
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != mode:
        return "updated"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as f:
            same = f.read() == text
    except (OSError, UnicodeDecodeError):
        return "updated"
    return "unchanged" if same else "updated"


def install(args: argparse.Namespace) -> int:
    """Write every file and link (each line says installed, updated or
    unchanged: over an older install, what the upgrade changed), remove what
    the older one had and this one does not, and keep /etc/hostd."""
    root = Path(args.root)
    refusals, warnings = check_code_location(args.python or sys.executable)
    for warning in warnings:
        print(f"hostd install: {warning}", file=sys.stderr)
    if refusals:
        for refusal in refusals:
            print(f"hostd install: refused: {refusal}", file=sys.stderr)
        print("hostd install: nothing was written", file=sys.stderr)
        return 1
    files = planned_files(args)
    counts: dict[str, int] = {}
    for path, (text, mode) in files.items():
        change = file_change(path, text, mode)
        if change != "unchanged":
            write_atomic(path, text, mode=mode)
        counts[change] = counts.get(change, 0) + 1
        print(f"{change} {path}")
    for link, target in planned_links(args).items():
        change = "unchanged" if link.is_symlink() and os.readlink(link) == str(target) else \
            "updated" if link.is_symlink() else "installed"
        if place_link(link, target):
            files[link] = ("", 0)
            counts[change] = counts.get(change, 0) + 1
            print(f"{change} {link} -> {target}")
    state = root / "var/lib/hostd"
    config = root / args.config_dir.lstrip("/")
    counts["removed"] = remove_stale(state / MANIFEST, files, config)
    (config / "models").mkdir(parents=True, exist_ok=True)
    example = data_dir("packaging").parent / "etc" / "hostd.yaml"
    if not (config / "hostd.yaml").exists() and example.is_file():
        write_atomic(config / "hostd.yaml", example.read_text())
        files[config / "hostd.yaml"] = ("", 0)
        print(f"installed {config / 'hostd.yaml'} (example)")
    else:
        print(f"kept {config} as it is (the administrator's configuration)")
    print("hostd install: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("installed", "updated", "unchanged",
                                                                              "removed")))
    state.mkdir(parents=True, exist_ok=True)
    write_atomic(state / MANIFEST, "".join(f"{p}\n" for p in files))
    if args.root == "/":
        run_tool("systemd-sysusers", str(root / SYSUSERS))
        run_tool("systemd-tmpfiles", "--create", str(root / TMPFILES))
        if systemd_running() and not args.no_reload:
            run_tool("systemctl", "daemon-reload")
            run_tool("systemctl", "try-reload-or-restart", "dbus.service")
    return 0


def remove_listed(names: list[str], keep: Callable[[Path], bool], why: str = "") -> int:
    """Remove each file or link NAMES lists that is there, except those KEEP
    says; how many were removed."""
    removed = 0
    for name in names:
        path = Path(name)
        if keep(path) or not (path.exists() or path.is_symlink()):
            continue
        path.unlink()
        removed += 1
        print(f"removed {path}{why}")
    return removed


def remove_stale(manifest: Path, planned: dict, config: Path) -> int:
    """Remove what an earlier install wrote and this one does not (an upgrade
    from a version that used other directories); configuration stays. How
    many were removed."""
    if not manifest.exists():
        return 0
    return remove_listed(manifest.read_text().split(), lambda path: path in planned or path.parent == config,
                         " (no longer installed there)")


def uninstall(args: argparse.Namespace) -> int:
    root = Path(args.root)
    config = root / args.config_dir.lstrip("/")
    manifest = root / "var/lib/hostd" / MANIFEST
    listed = manifest.read_text().split() if manifest.exists() else [str(p) for p in planned_files(args)]
    remove_listed(listed, lambda path: path.parent == config and not args.purge)
    manifest.unlink(missing_ok=True)
    try:
        (root / COCKPIT_DIR).rmdir()  # hostd's own directory; one with others' files in it stays
    except OSError:
        pass
    if args.purge:
        shutil.rmtree(config, ignore_errors=True)
        print(f"removed {config}")
    if args.root == "/" and systemd_running() and not args.no_reload:
        run_tool("systemctl", "daemon-reload")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="install below this directory (packaging, tests)")
    parser.add_argument("--unit-dir", default="/usr/local/lib/systemd/system",
                        help="unit templates (default: %(default)s; /etc/systemd/system is the administrator's)")
    parser.add_argument("--generator-dir", default="/usr/local/lib/systemd/system-generators")
    parser.add_argument("--bin-dir", default="/usr/local/bin", help="links to hostd and hostctl (default: %(default)s)")
    parser.add_argument("--python", help="interpreter the units run (default: this one)")
    parser.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    parser.add_argument("--purge", action="store_true", help="uninstall: also remove /etc/hostd")


def run(args: argparse.Namespace) -> int:
    args.config_dir = str(args.config_dir or "/etc/hostd")
    return uninstall(args) if args.command == "uninstall" else install(args)
