"""Boot a real systemd (PID 1) in a throwaway ``systemd-nspawn`` container.

The system tests need a genuine service manager: Type=notify start-up,
template units, ``RuntimeDirectory=``, journald and the D-Bus API all behave
as they do on a production host only when systemd itself is running them.
The machine running the tests, however, usually does not have systemd as its
own PID 1 (CI runners, developer containers), and it must never get one:
booting systemd on the host's root filesystem would run ``systemd-tmpfiles``
and friends against the real ``/tmp``, ``/var`` and ``/etc`` and wreck the
machine.

So this module only ever boots systemd as

    systemd-nspawn --directory=/ --volatile=yes --register=no --keep-unit --boot

``--volatile=yes`` gives the container a fresh tmpfs as its root with only the
host's ``/usr`` mounted in, read-only; ``/etc``, ``/var`` and ``/tmp`` are the
container's own and vanish with it.  Nothing of the host is visible inside
except what is bound in explicitly: the checkout and the Python installation
(both read-only), a host directory that becomes ``/etc/systemd/system``
(writable, so tests can install unit files), a fixed ``/etc/machine-id``,
writable overlays over ``/usr/local`` and ``/usr/share/dbus-1`` (see
WRITABLE_USR) and any extra binds a test asks for.  The host's ``/tmp`` is never bound.

``--register=no --keep-unit`` keep nspawn from talking to a host systemd or
systemd-machined (there is none).  Commands run inside through
``nsenter -t <container PID 1> -a``.  Stopping sends SIGTERM to nspawn (which
powers the container off cleanly), falls back to SIGKILL, and then proves that
no process of the container's PID namespace is left on the machine.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Name of the minimal default target the container boots into.
TEST_TARGET = "hostd-test.target"

TEST_TARGET_UNIT = """\
[Unit]
Description=hostd system-test target (journald + system bus only)
Requires=dbus.socket systemd-journald.socket
After=dbus.socket systemd-journald.socket
AllowIsolate=yes
"""

#: Where the writable units directory appears inside the container.
CONTAINER_UNITS_DIR = "/etc/systemd/system"

#: polkitd reads actions only under /usr, which is the host's and read-only
#: inside: each gets an empty writable directory of the container's own, so
#: `hostd install` can put its polkit files where a real host has them.
POLKIT_DIRS = ("/usr/share/polkit-1/actions", "/usr/share/polkit-1/rules.d")

#: Host directories under the read-only /usr that the container sees
#: writable, through an overlay whose upper layer nspawn keeps in a temporary
#: directory and removes with the container: where `hostd install` puts vendor
#: files (/usr/local/lib/systemd, /usr/local/bin, dbus-daemon's
#: /usr/share/dbus-1). The host's own directories are never written.
WRITABLE_USR = ("/usr/local", "/usr/share/dbus-1")

#: Environment for commands run inside the container; nothing of the
#: caller's environment (virtualenv, pyenv shims, pager settings) leaks in.
INSIDE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}


class ContainerError(RuntimeError):
    """The container could not be booted, driven or stopped."""


class ContainerLeak(ContainerError):
    """Processes of the container survived its shutdown."""


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the container."""

    source: Path
    target: Path
    readonly: bool = True

    def nspawn_arg(self) -> str:
        option = "--bind-ro" if self.readonly else "--bind"
        return f"{option}={_escape(self.source)}:{_escape(self.target)}"


def _escape(path: Path) -> str:
    # nspawn splits --bind= on ':'; a literal colon is written as '\:'.
    return str(path).replace("\\", "\\\\").replace(":", "\\:")


# --------------------------------------------------------------------------
# Host checks and path helpers
# --------------------------------------------------------------------------


def host_support_problem() -> str | None:
    """Why containers cannot be booted on this machine, or None if they can."""
    if not sys.platform.startswith("linux"):
        return "systemd-nspawn system tests need Linux"
    if os.geteuid() != 0:
        return "systemd-nspawn system tests need root"
    for tool in ("systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container util-linux)"
    if not any(Path(p).exists() for p in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd")):
        return "systemd is not installed on this machine"
    return None


def find_checkout(start: Path) -> Path:
    """The repository root: the nearest directory above ``start`` holding
    ``.git`` or ``pyproject.toml``."""
    start = start.resolve()
    for directory in (start, *start.parents):
        if (directory / ".git").exists() or (directory / "pyproject.toml").exists():
            return directory
    raise ContainerError(f"no checkout (.git / pyproject.toml) found above {start}")


def python_paths() -> list[Path]:
    """Directories the running interpreter needs: the (virtual) environment
    and the base installation it was created from, symlinks resolved."""
    candidates = (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)
    return _dedupe(Path(p).resolve() for p in candidates)


def _is_within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _dedupe(paths: Iterable[Path]) -> list[Path]:
    """Drop duplicates and paths nested in another one (or in /usr, which
    --volatile=yes already provides)."""
    kept: list[Path] = []
    for path in sorted(set(paths), key=lambda p: len(p.parts)):
        if _is_within(path, Path("/usr")):
            continue
        if not any(_is_within(path, k) for k in kept):
            kept.append(path)
    return kept


def wait_for(
    probe: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Call ``probe`` until it returns something truthy; return that value.
    Raises TimeoutError mentioning ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:  # gone, or a kernel thread / zombie without namespaces
        return None


def processes_in_pid_namespace(namespace: str) -> list[int]:
    """PIDs (host view) of all processes whose PID namespace is ``namespace``
    (as read from /proc/<pid>/ns/pid, e.g. ``pid:[4026532181]``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _pid_namespace(int(entry)) == namespace:
            pids.append(int(entry))
    return pids


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    children: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            children.extend(int(c) for c in (task / "children").read_text().split())
        return children
    except FileNotFoundError:
        pass  # no CONFIG_PROC_CHILDREN (or pid gone): scan every process
    except OSError:
        return children
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..." -- comm may contain spaces and parens.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return children


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------
# The container
# --------------------------------------------------------------------------


class SystemdContainer:
    """A systemd 252 booted with ``systemd-nspawn --volatile=yes`` on the
    host's own ``/usr``.

    Usage::

        with SystemdContainer() as c:
            c.install_unit("foo.service", "...")
            c.systemctl("start", "foo.service")
            c.sh("journalctl -u foo.service")

    ``units_dir`` is a host directory bound writable onto
    ``/etc/systemd/system``; :meth:`install_unit` writes there and reloads.

    A machine whose systemd is not the host's own (the GPU machine: no
    systemd at all, Debian 12's packages unpacked beside it) overrides the
    four hooks below: which nspawn runs and with what environment, what
    stops a boot here, and which parts of /usr are made writable.
    """

    #: The systemd-nspawn that boots the container.
    nspawn_binary = "systemd-nspawn"
    #: Host directories under /usr that the container sees writable (WRITABLE_USR).
    writable_usr: tuple[str, ...] = WRITABLE_USR

    def __init__(
        self,
        *,
        checkout: Path | None = None,
        workdir: Path | None = None,
        binds: Sequence[Bind] = (),
        boot_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        nspawn_args: Sequence[str] = (),
    ) -> None:
        self.checkout = (checkout or find_checkout(Path(__file__))).resolve()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hostd-nspawn-")).resolve()
        self.units_dir = self.workdir / "units"
        self.log_path = self.workdir / "nspawn.log"
        self.machine = f"hostd-test-{secrets.token_hex(4)}"
        self.boot_timeout = boot_timeout
        self.stop_timeout = stop_timeout
        self._extra_binds = list(binds)
        self._nspawn_args = list(nspawn_args)  # e.g. --capability=CAP_NET_ADMIN

        self.nspawn: subprocess.Popen[bytes] | None = None
        self.pid1: int | None = None
        self.pid_namespace: str | None = None
        self.boot_seconds: float | None = None
        self.system_state: str | None = None
        self._log_file = None

    # -- configuration -----------------------------------------------------

    def add_bind(self, source: str | Path, target: str | Path | None = None, *, readonly: bool = True) -> None:
        """Bind host ``source`` to ``target`` (default: the same path) inside.
        Only before :meth:`start`."""
        if self.nspawn is not None:
            raise ContainerError("binds must be added before start()")
        source = Path(source).resolve()
        self._extra_binds.append(Bind(source, Path(target or source), readonly))

    @property
    def binds(self) -> list[Bind]:
        binds = [Bind(p, p) for p in _dedupe([self.checkout, *python_paths()])]
        binds.append(Bind(self.units_dir, Path(CONTAINER_UNITS_DIR), readonly=False))
        binds.append(Bind(self.workdir / "machine-id", Path("/etc/machine-id")))
        binds += [Bind(self.workdir / Path(d).name, Path(d), readonly=False) for d in POLKIT_DIRS
                  if Path(d).is_dir()]
        return binds + self._extra_binds

    @property
    def python(self) -> str:
        """The running interpreter, as a path valid inside the container."""
        exe = Path(sys.executable)
        return str(exe.parent.resolve() / exe.name)

    def nspawn_command(self) -> list[str]:
        return [
            self.nspawn_binary,
            "--directory=/",
            "--volatile=yes",
            "--register=no",
            "--keep-unit",
            "--settings=no",
            "--boot",
            f"--machine={self.machine}",
            *(b.nspawn_arg() for b in self.binds),
            *(f"--overlay={_escape(Path(d))}::{_escape(Path(d))}" for d in self.writable_usr if Path(d).is_dir()),
            # What a host's PID 1 has and nspawn drops by default: systemd
            # brings up the loopback device of each PrivateNetwork= unit
            # (the engine and weights units) with it; without it that
            # loopback stays down and SGLang's and vLLM's local ports fail.
            "--capability=CAP_NET_ADMIN",
            *self._nspawn_args,
            "--",
            # firstboot=off: never prompt.  A pre-made /etc/machine-id also
            # keeps systemd out of first-boot mode, so it does not run
            # preset-all and fill our units dir with enablement symlinks.
            "systemd.firstboot=off",
            f"systemd.unit={TEST_TARGET}",
        ]

    def support_problem(self) -> str | None:
        """Why this container cannot be booted here, or None."""
        return host_support_problem()

    def nspawn_env(self) -> dict[str, str] | None:
        """The environment nspawn runs with (None: this process's)."""
        return None

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> SystemdContainer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.nspawn is not None and self.nspawn.poll() is None

    def start(self) -> SystemdContainer:
        """Boot the container and wait until it is up; returns self."""
        if self.nspawn is not None:
            raise ContainerError("container already started")
        problem = self.support_problem()
        if problem:
            raise ContainerError(problem)
        self._prepare_workdir()
        started = time.monotonic()
        self._log_file = open(self.log_path, "wb")
        log.info("booting %s: %s", self.machine, " ".join(self.nspawn_command()))
        self.nspawn = subprocess.Popen(
            self.nspawn_command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a ^C in pytest must not hit nspawn directly
            env=self.nspawn_env(),
        )
        try:
            deadline = started + self.boot_timeout
            self.pid1 = self._find_pid1(deadline)
            self.pid_namespace = _pid_namespace(self.pid1)
            if self.pid_namespace is None:
                raise ContainerError(f"cannot read the PID namespace of container PID 1 ({self.pid1})")
            self.system_state = self._wait_until_booted(deadline)
        except BaseException:
            self.stop(check=False)
            raise
        self.boot_seconds = time.monotonic() - started
        log.info("%s is %s after %.1fs", self.machine, self.system_state, self.boot_seconds)
        return self

    def _prepare_workdir(self) -> None:
        self.units_dir.mkdir(parents=True, exist_ok=True)
        (self.units_dir / TEST_TARGET).write_text(TEST_TARGET_UNIT)
        # The bound machine-id sits on the host's disk, so the commit service
        # (meant for a tmpfs machine-id) would fail and degrade the system.
        mask = self.units_dir / "systemd-machine-id-commit.service"
        if not mask.is_symlink():
            mask.symlink_to("/dev/null")
        (self.workdir / "machine-id").write_text(secrets.token_hex(16) + "\n")
        for directory in POLKIT_DIRS:
            (self.workdir / Path(directory).name).mkdir(exist_ok=True)

    def _find_pid1(self, deadline: float) -> int:
        """The container's PID 1: the child of nspawn that has exec'd systemd."""
        assert self.nspawn is not None
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(
                    f"systemd-nspawn exited with {self.nspawn.returncode} during boot\n{self.log_text()}"
                )
            for child in _children(self.nspawn.pid):
                if _comm(child) == "systemd":
                    return child
            time.sleep(0.02)
        raise ContainerError(f"container PID 1 did not appear within {self.boot_timeout:g}s\n{self.log_text()}")

    def _wait_until_booted(self, deadline: float) -> str:
        assert self.nspawn is not None
        state = "unknown"
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(
                    f"systemd-nspawn exited with {self.nspawn.returncode} during boot\n{self.log_text()}"
                )
            state = self.run(["systemctl", "is-system-running"], check=False, timeout=10).stdout.strip()
            if state == "running":
                return state
            if state == "degraded":
                # A unit failed during boot: every test after it would run on a
                # broken machine, so the boot fails and names the units.
                failed = self.run(["systemctl", "--failed", "--no-legend", "--full"], check=False).stdout
                raise ContainerError(f"container {self.machine} booted degraded; failed units:\n{failed}"
                                     f"--- nspawn log ---\n{self.log_text()}")
            if state in ("maintenance", "stopping"):
                break
            time.sleep(0.1)
        raise ContainerError(
            f"container {self.machine} did not reach 'running' within {self.boot_timeout:g}s "
            f"(last state: {state!r})\n--- nspawn log ---\n{self.log_text()}"
        )

    def stop(self, *, check: bool = True) -> None:
        """Power the container off and prove that none of its processes is
        left.  Idempotent.  With ``check`` (the default) raises
        :class:`ContainerLeak` if anything survived."""
        if self._log_file is not None:
            self._log_file.close()  # nspawn keeps its own descriptor
            self._log_file = None
        if self.nspawn is None:
            return
        if self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %gs; killing it", self.machine, self.stop_timeout)
                self._kill()

        leftovers = self.leftover_processes(grace=5.0)
        if leftovers:
            # Killing a PID namespace's init kills every process in it.
            self._kill()
            leftovers = self.leftover_processes(grace=5.0)
        if check and leftovers:
            raise ContainerLeak(
                f"{len(leftovers)} process(es) of {self.machine} survived shutdown: "
                + ", ".join(f"{pid} ({_comm(pid)})" for pid in leftovers)
            )
        if check and self.nspawn.returncode is None:
            raise ContainerLeak(f"systemd-nspawn ({self.nspawn.pid}) of {self.machine} is still running")
        if self._own_workdir and not leftovers:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill(self) -> None:
        assert self.nspawn is not None
        for pid in (self.pid1, self.nspawn.pid):
            # Only signal PID 1 while it is still in the container's namespace
            # (the number could otherwise have been reused by now).
            if pid is None or (pid == self.pid1 and _pid_namespace(pid) != self.pid_namespace):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.nspawn.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("systemd-nspawn (%d) survived SIGKILL", self.nspawn.pid)

    def leftover_processes(self, *, grace: float = 0.0) -> list[int]:
        """Processes still in the container's PID namespace (host PIDs),
        waiting up to ``grace`` seconds for them to disappear."""
        if self.pid_namespace is None:
            return []
        deadline = time.monotonic() + grace
        while True:
            pids = processes_in_pid_namespace(self.pid_namespace)
            if not pids or time.monotonic() >= deadline:
                return pids
            time.sleep(0.05)

    def log_text(self) -> str:
        """Everything nspawn and the container console printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- running things inside ---------------------------------------------

    def run(
        self,
        args: Sequence[str],
        *,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` inside the container (all its namespaces) and return
        the completed process with text stdout/stderr.  With ``check`` a
        non-zero exit raises :class:`ContainerError` showing both streams.
        A ``journalctl`` read sees all that was logged before it (below)."""
        if self.pid1 is None or not self.running:
            raise ContainerError("container is not running")
        if list(args[:1]) == ["journalctl"] and "--sync" not in args:
            # journald reads what units wrote on its own time: a read made as
            # soon as a unit failed once lacked both its refusal and systemd's
            # own lines about it (stop 64, a local run). --sync returns once
            # journald has taken in everything queued to it before.
            self.run(["journalctl", "--sync"], check=False, timeout=timeout)
        command = ["nsenter", "-t", str(self.pid1), "-a", "--", *args]
        proc = subprocess.run(
            command,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**INSIDE_ENV, **(env or {})},
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise ContainerError(
                f"{' '.join(args)!r} failed with exit status {proc.returncode} in {self.machine}\n"
                f"--- stdout ---\n{proc.stdout}--- stderr ---\n{proc.stderr}"
            )
        return proc

    def sh(self, script: str, **kwargs) -> subprocess.CompletedProcess[str]:
        """Run a shell script inside (``sh -ec``); keyword arguments as for run()."""
        return self.run(["sh", "-ec", script], **kwargs)

    def systemctl(self, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        """A failed start/restart/reload shows the journal's end: the container is gone when a report is read."""
        try:
            return self.run(["systemctl", *args], **kwargs)
        except ContainerError as exc:
            if not {"start", "restart", "reload", "reload-or-restart"} & set(args):
                raise
            journal = self.run(["journalctl", "-n", "80", "-o", "short-monotonic", "--no-pager"], check=False).stdout
            raise ContainerError(f"{exc}\n--- the journal's last 80 lines ---\n{journal}") from None

    def write_file(self, path: str, text: str, *, mode: int = 0o644) -> None:
        """Create or replace ``path`` inside the container (parents created)."""
        self.run(
            ["sh", "-ec", 'mkdir -p "$(dirname "$1")"; cat > "$1"; chmod "$2" "$1"', "sh", path, f"{mode:o}"],
            input=text,
        )

    def write_model_yaml(self, name: str, text: str, path: str | None = None) -> None:
        """A file of model NAME holding env: values (its YAML, or PATH), kept
        to root and the model's user as hostd/secretfiles.py requires (root,
        group hostd-NAME, 0640): the model's user made first, as
        model@NAME.socket makes it (the same systemd-sysusers line), so the
        group exists."""
        user = f"hostd-{name}"
        path = path or f"/etc/hostd/models/{name}.yaml"
        self.run(["systemd-sysusers", "--inline", f'u {user} - "hostd model {name}" /var/lib/hostd/{name}'])
        self.write_file(path, text, mode=0o640)
        self.run(["chown", f"root:{user}", path])

    def read_file(self, path: str) -> str:
        return self.run(["cat", "--", path]).stdout

    def install_unit(self, name: str, text: str, *, reload: bool = True) -> str:
        """Write unit ``name`` to the units dir and ``daemon-reload``;
        returns its path inside the container."""
        (self.units_dir / name).write_text(text)
        if reload:
            self.systemctl("daemon-reload")
        return f"{CONTAINER_UNITS_DIR}/{name}"

    def journal(self, unit: str | None = None, *args: str) -> list[dict]:
        """Journal entries (``journalctl -o json``), optionally for one unit."""
        command = ["journalctl", "--no-pager", "-o", "json", *args]
        if unit is not None:
            command += ["-u", unit]
        lines = self.run(command).stdout.splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def busctl_json(self, *args: str) -> object:
        """``busctl --json=short ARGS`` on the system bus, decoded."""
        return json.loads(self.run(["busctl", "--json=short", *args]).stdout)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<SystemdContainer {self.machine} {state} pid1={self.pid1}>"
