"""hostd-generator: turn /etc/hostd/models/*.yaml into unit drop-ins.

Installed into systemd's system-generators directory; systemd runs it early at
boot and on every `systemctl daemon-reload` as

    hostd-generator NORMAL_DIR EARLY_DIR LATE_DIR

For each valid model it writes, into NORMAL_DIR:

- model@NAME.socket.d/50-hostd.conf: ListenStream= from `listen:`
- model@NAME.service.d, model-engine@NAME.service.d, model-engine-next@NAME.service.d
  (the overlap reload's second engine), model-engine-standby@NAME.service.d
  (the warm standby), model-engine-spare@NAME.service.d (the pre-imported
  spare), model-weights@NAME.service.d, and a checkpoint swap's
  model-weights-next@NAME.service.d and model-engine-swap@NAME.service.d
  /50-hostd.conf: start/stop timeouts from `timeouts:`; the engines and the
  weights daemon run as the model's own user; for CUDA models the
  GPUs (CUDA_VISIBLE_DEVICES, counted in PCI bus order) and DeviceAllow= for
  the NVIDIA devices, each GPU by the minor number NVML reports for it (a
  model whose `gpus:` names a GPU that NVML says this host lacks is treated
  as a broken config, below: its start fails at once, saying so)
- model@NAME.service.d/50-hostd.conf also: LoadCredential= for `gateway.api_keys`,
  ReadWritePaths= for the directory of a Unix `gateway.metrics_listen`
- model@NAME.service.d/50-hostd-standby.conf: Wants=model-engine-standby@NAME
  for `standby: true`; otherwise model-engine-standby@NAME.service.d/50-hostd-standby.conf:
  ExecCondition=/bin/false, so that the standby never starts (a restart of the
  model stops one left from before `standby: true` was removed)
- model@NAME.service.d/50-hostd-spare.conf: Wants=model-engine-spare@NAME for
  `spare: true`, with Delegate=yes in model-engine@NAME's 50-hostd.conf (the
  engine's process comes from the spare: hostd/engine/handoff.py); otherwise
  the spare's own 50-hostd-spare.conf: ExecCondition=/bin/false, as the standby's
- multi-user.target.wants/model@NAME.service for `autostart: true`

Every drop-in names the YAML it came from (SourcePath=, as podman's Quadlet
does), so `systemctl status` and `systemctl cat` point at it.

A model whose YAML is broken is logged (to the journal or the kernel log, where
early boot messages go, and stderr) and gets drop-ins that make its units fail
at start with a message naming the file and the problem (instead of systemd's
"Unit has no Listen setting"); the generator itself never fails, so a typo can
never fail the boot.

The public socket's ListenStream= never changes under a running socket: on a
daemon-reload systemd 252 closes a running socket unit's descriptors whose
address changed ("Socket unit configuration has changed while unit has been
running, no open socket file descriptor left") and the socket stays dead
until restarted by hand. So the address each model's socket was generated
with is kept in STATE_DIR (root's, /run: it lasts until the next boot, as the
sockets do), and while the socket runs (its runtime directory /run/hostd/NAME
exists) the generator writes that address again: for a broken config (whose
socket text then only gains the commands that fail its next start) and for a
changed `listen:`, which is logged and takes effect when the model is next
stopped and started.

    hostd-generator --dry-run      # print what would be written; write nothing
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from hostd import accounts, backends, config, nvml, paths, units

DROPIN = "50-hostd.conf"
STANDBY_DROPIN = "50-hostd-standby.conf"  # model@NAME.service.d: Wants= the standby (`standby: true`)
SPARE_DROPIN = "50-hostd-spare.conf"  # model@NAME.service.d: Wants= the spare (`spare: true`)
# model-engine-standby@NAME.service.d/STANDBY_DROPIN without `standby: true`:
# a start is skipped (exit 1 of ExecCondition=: not a failure, no restart).
STANDBY_OFF = "ExecCondition=/bin/false\n"
UNIT_DIR_ENV = "HOSTD_UNIT_DIR"
STATE_DIR = Path("/run/hostd-generator")  # NAME.listen: the address model@NAME.socket was generated with
STATE_DIR_ENV = "HOSTD_GENERATOR_STATE_DIR"  # moves it, for tests


def log(message: str) -> None:
    """Warn where an administrator looks: the journal when it runs (daemon-reload),
    else the kernel log (early boot); always stderr."""
    line = f"hostd-generator: {message}"
    print(line, file=sys.stderr)
    try:
        from logging_journald import JournaldTransport

        JournaldTransport().send(
            [("message", line), ("priority", 4), ("syslog_identifier", "hostd-generator")]
        )
        return
    except Exception:
        pass
    try:
        with open("/dev/kmsg", "w") as kmsg:
            kmsg.write(f"<4>{line}\n")
    except OSError:
        pass


def gpu_lines(name: str, cfg) -> tuple[list[str], list[str]]:
    """The lines of the units that open the model's GPUs, and the gateway's
    (HOSTD_GPUS: each GPU's index and UUIDs, for its metrics; it opens none)."""
    if not backends.for_config(cfg).uses_gpu(cfg):
        return [], []
    # CUDA takes the config's names as they are: indices, GPU- and MIG- UUIDs.
    lines = [
        "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID",
        f"Environment=CUDA_VISIBLE_DEVICES={','.join(str(g) for g in cfg.gpus)}",
        "DeviceAllow=/dev/nvidiactl rw",
        "DeviceAllow=/dev/nvidia-uvm rw",
        "DeviceAllow=/dev/nvidia-uvm-tools rw",
        "DeviceAllow=/dev/nvidia-modeset rw",
    ]
    try:
        found = nvml.describe(list(cfg.gpus))  # at each daemon-reload: indices, UUIDs and slices change
    except nvml.NoSuchGpu:
        raise  # the model's config is wrong for this host: plan() makes its start fail, saying so
    except Exception as exc:  # no driver or NVML at generation time
        # Without the minor numbers no single GPU can be named; allowing every
        # NVIDIA GPU keeps the model working, and the log says so.
        log(f"model {name!r}: cannot read GPU minor numbers from NVML ({exc}); "
            "allowing every NVIDIA GPU device (char-nvidia-frontend)")
        return lines + ["DeviceAllow=char-nvidia-caps r", "DeviceAllow=char-nvidia-frontend rw"], []
    lines += [f"DeviceAllow=/dev/nvidia{minor} rw" for minor in dict.fromkeys(g.minor for g in found)]
    described = ",".join(f"{g.index}/{g.uuid}/{g.mig_uuid}/{g.mig[0] if g.mig else ''}" for g in found)
    return lines + capability_lines(name, found), [f"Environment=HOSTD_GPUS={described}"]


def capability_lines(name: str, found: list[nvml.Gpu]) -> list[str]:
    """DeviceAllow= for /dev/nvidia-caps: a model on MIG slices alone may
    open its slices' capability devices and no other slice's; any other
    model every capability device, for reading (what it had before MIG)."""
    if not found or any(g.mig is None for g in found):
        return ["DeviceAllow=char-nvidia-caps r"]
    try:
        minors = [minor for g in found for minor in nvml.mig_capability_minors(g)]
    except OSError as exc:
        log(f"model {name!r}: cannot read the MIG slices' capability devices ({exc}); "
            "allowing every one (char-nvidia-caps)")
        return ["DeviceAllow=char-nvidia-caps r"]
    return [f"DeviceAllow=/dev/nvidia-caps/nvidia-cap{minor} r" for minor in dict.fromkeys(minors)]


def unit_value(value: str) -> str:
    """VALUE as one unit-file setting value (systemd.syntax(7)): no control
    characters (the schema refuses them; a newline would start a new setting),
    and '%' written '%%' so that no specifier is expanded."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"{value!r} contains a control character")
    return value.replace("%", "%%")


def credential_lines(cfg) -> list[str]:
    """The gateway's keys files (the API keys, the metrics token), each passed
    as its credential (hostd/gateway/keys.py: api-keys, metrics-token)."""
    from hostd.gateway import keys  # no aiohttp there: the generator runs at boot

    return [f"LoadCredential={of.credential}:{unit_value(of.configured(cfg.gateway))}"
            for of in keys.KEYS_FILES if of.configured(cfg.gateway)]


def metrics_listen_lines(cfg) -> list[str]:
    """A Unix socket for gateway.metrics_listen, which the gateway binds itself
    (hostd/gateway/metrics_listener.py): its directory is made writable in the
    gateway's read-only file system (ProtectSystem=strict); '-': a missing one
    fails the gateway's bind, naming the key, not the unit's namespace setup.
    A loopback TCP address needs nothing: the sandbox allows AF_INET(6) and
    denies no IP address."""
    listen = cfg.gateway.metrics_listen
    if not listen or not listen.startswith("/"):
        return []
    return [f"ReadWritePaths=-{unit_value(str(Path(listen).parent))}"]


def _header(name: str, source: Path) -> str:
    return (f"# Generated by hostd-generator from the config of model {name}; do not edit.\n"
            f"[Unit]\nSourcePath={unit_value(str(source))}\n")


def socket_text(name: str, listen: str) -> str:
    """The [Socket] settings of model@NAME.socket listening on LISTEN."""
    return "[Socket]\n" + f"ListenStream={unit_value(listen)}\n" + model_user_lines(name)


def dropins(name: str, cfg, source: Optional[Path] = None, listen: Optional[str] = None) -> dict[str, str]:
    """Relative path -> content of every file generated for model NAME (whose
    YAML is SOURCE, by default /etc/hostd/models/NAME.yaml); the socket
    listens on LISTEN (by default the config's `listen:`)."""
    header = _header(name, source or config.model_file(name))
    timeouts = [f"TimeoutStartSec={cfg.timeouts.start}", f"TimeoutStopSec={cfg.timeouts.stop}"]
    gpu, gateway_gpu = gpu_lines(name, cfg)  # one NVML reading for all of the model's units
    files = {
        f"{units.socket(name)}.d/{DROPIN}": header + socket_text(name, cfg.listen if listen is None else listen),
        **{f"{units.weights_socket(name, slot)}.d/{DROPIN}": header + "[Socket]\n"
           + f"SocketUser={units.user(name)}\nSocketGroup={units.user(name)}\n" for slot in ("main", "next")},
        f"{units.umbrella(name)}.d/{DROPIN}": header + "[Service]\n" + "\n".join(timeouts + run_as(name) + credential_lines(cfg) + metrics_listen_lines(cfg)
                                                         + gateway_gpu) + "\n",
    }
    spare = getattr(cfg, "spare", False)
    for unit in (units.engine(name), units.engine(name, "next"), units.engine(name, "standby"), units.swap_engine(name),
                 units.spare(name), units.weights(name), units.weights(name, "next")):
        # Delegate=: systemd moves a process into a unit's cgroup only for
        # a delegated unit (AttachProcessesToUnit), which is how the main
        # engine's process comes from the spare (hostd/engine/handoff.py).
        delegate = ["Delegate=yes"] if spare and unit == units.engine(name) else []
        body = "\n".join(timeouts + run_as(name) + gpu + delegate)
        files[f"{unit}.d/{DROPIN}"] = header + "[Service]\n" + body + "\n"
    if getattr(cfg, "standby", False):
        # The umbrella wants the warm standby as it wants the main engine: a
        # start of the model starts it, a restart restarts it (its PartOf=).
        files[f"{units.umbrella(name)}.d/{STANDBY_DROPIN}"] = (
            header + "[Unit]\n" + f"Wants={units.engine(name, 'standby')}\n")
    else:
        # No standby asked for: the unit never starts. A standby left from
        # before `standby: true` was removed is restarted by a restart of the
        # model (PartOf=): that start is skipped, so the restart stops it
        # instead of keeping a second engine and its memory.
        files[f"{units.engine(name, 'standby')}.d/{STANDBY_DROPIN}"] = (
            header + "[Service]\n" + STANDBY_OFF)
    if spare:
        files[f"{units.umbrella(name)}.d/{SPARE_DROPIN}"] = header + "[Unit]\n" + f"Wants={units.spare(name)}\n"
    else:
        # As the standby: never started, and a restart of the model stops one left from before.
        files[f"{units.spare(name)}.d/{SPARE_DROPIN}"] = header + "[Service]\n" + STANDBY_OFF
    return files


def run_as(name: str) -> list[str]:
    """Every service of model NAME runs as the model's own user (units.user)."""
    return [f"User={units.user(name)}", f"Group={units.user(name)}"]


def model_user_lines(name: str) -> str:
    """model@NAME.socket, first of the model's units to start, refuses an
    account or directory that is not the model's own, then creates the
    model's user (as root: '+', since the template runs the socket's commands
    as the shared user; systemd-sysusers does nothing when the user exists),
    refuses a file of the model's secrets that others can read, and hands it the private runtime directory (the socket's RuntimeDirectory=,
    which systemd removes when the socket stops), in place of the template's
    placeholder command."""
    user = units.user(name)
    return (
        "ExecStartPre=\n"
        # First, as root: the account and directories are the model's own
        # (hostd/accounts.py), before systemd-sysusers keeps an existing user.
        f"ExecStartPre=+{unit_value(sys.executable)} -m hostd.accounts %i\n"
        f"ExecStartPre=+/usr/bin/systemd-sysusers --inline {_unit_quote(accounts.sysusers_entry(name))}\n"
        # Then: no secret of the model in a file others can read
        # (hostd/secretfiles.py); after sysusers, so that the group its
        # chown names exists.
        f"ExecStartPre=+{unit_value(sys.executable)} -m hostd.secretfiles %i\n"
        f"ExecStartPre=+/usr/bin/install -d -m 0700 -o {user} -g {user} /run/hostd/%i\n"
    )


def _unit_quote(text: str) -> str:
    """TEXT as one double-quoted word of a unit file's command line."""
    text = " ".join(text.split())  # one line
    for raw, escaped in (("\\", "\\\\"), ('"', '\\"'), ("%", "%%"), ("$", "$$")):
        text = text.replace(raw, escaped)
    return f'"{text}"'


def failing_dropins(name: str, source: Path, problem: str, listen: Optional[str] = None) -> dict[str, str]:
    """Drop-ins for a model whose config is invalid: its socket (started first
    by every unit of the model) fails at start, printing the file and the
    problem to the journal; the descriptions say it in `systemctl status`.
    LISTEN: the address of the model's running socket, kept as it is (only
    the commands of its next start change); None when it does not run."""
    header = _header(name, source)
    summary = " ".join(problem.split())
    message = f"hostd: model {name} is not started: invalid configuration: {summary}"
    description = (f"Description=hostd model {name}: INVALID CONFIG {unit_value(str(source))} "
                   f"(see journalctl -u {units.socket(name)})\n")
    if listen is None:
        # Any address: the socket never gets to listen (ExecStartPre= fails first).
        socket = f"[Socket]\nListenStream=/run/hostd/{name}/invalid-config.sock\n"
    else:
        socket = socket_text(name, listen)
    return {
        f"{units.socket(name)}.d/{DROPIN}": header + description + socket
        + f"ExecStartPre=/bin/echo {_unit_quote(message)}\nExecStartPre=/bin/false\n",
        f"{units.umbrella(name)}.d/{DROPIN}": header + description,
    }


def _is_unit_instance(name: str) -> bool:
    """Can NAME be a template instance at all (else no unit can be named for it)?"""
    return bool(name) and len(name) < 200 and all(c.isalnum() or c in ":_.-" for c in name)


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or STATE_DIR)


def _kept_listen(name: str, state: Path) -> Optional[str]:
    """The address model@NAME.socket runs with, when it runs and the generator
    wrote it (STATE/NAME.listen), else None."""
    if not paths.runtime_dir(name).is_dir():  # the socket's RuntimeDirectory=: it does not run
        return None
    try:
        return (state / f"{name}.listen").read_text()
    except (OSError, UnicodeDecodeError):
        return None


def plan(root: Optional[Path] = None, state: Optional[Path] = None) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """Relative path -> content of every file to generate (drop-ins; a value
    starting with "->" is a symlink target), the names of the valid models,
    and model name -> the address its socket is generated with (for STATE;
    without STATE no address is kept)."""
    files: dict[str, str] = {}
    done = []
    listens: dict[str, str] = {}
    for name in config.list_models(root):
        source = config.model_file(name, root)
        kept = _kept_listen(name, state) if state is not None and _is_unit_instance(name) else None

        def skip(problem: str) -> None:
            log(f"skipping model {name!r}: {problem}".replace("\n", "; "))
            if _is_unit_instance(name):
                files.update(failing_dropins(name, source, problem, kept))
                if kept is not None:
                    listens[name] = kept

        try:
            cfg = config.load_model(name, root).config
        except Exception as exc:  # never fail the boot
            skip(str(exc) if isinstance(exc, config.ConfigError) else f"unexpected {type(exc).__name__}: {exc}")
            continue
        listen = cfg.listen
        if kept is not None and kept != listen:
            log(f"model {name!r}: listen: changed from {kept!r} to {listen!r} in {source}; "
                f"{units.socket(name)} keeps listening on {kept!r} while it runs (changing the address of a "
                f"running socket would close it) and takes the new one when the model is next stopped and "
                f"started: systemctl stop {units.umbrella(name)} && systemctl start {units.umbrella(name)}")
            listen = kept
        try:
            generated = dropins(name, cfg, source, listen)
        except nvml.NoSuchGpu as exc:
            skip(f"{source}: {exc}")
            continue
        files.update(generated)
        listens[name] = listen
        if cfg.autostart:
            files[f"multi-user.target.wants/{units.umbrella(name)}"] = "->"
        done.append(name)
    return files, done, listens


def write_state(state: Path, listens: dict[str, str]) -> None:
    """Keep the address of each model's socket for the next run; forget the others."""
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in state.glob("*.listen"):
        if old.name[: -len(".listen")] not in listens:
            old.unlink(missing_ok=True)
    for name, listen in listens.items():
        path = state / f"{name}.listen"
        try:
            if path.read_text() == listen:
                continue
        except (OSError, UnicodeDecodeError):
            pass
        tmp = state / f".{name}.listen.tmp"
        tmp.write_text(listen)
        os.replace(tmp, path)


def generate(normal_dir: Path, unit_dir: Path, root: Optional[Path] = None,
             state: Optional[Path] = None) -> list[str]:
    """Write drop-ins for every model; returns the names of the valid ones.
    STATE: where the sockets' addresses are kept (main() passes state_dir())."""
    files, done, listens = plan(root, state)
    for rel, text in files.items():
        path = normal_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if text == "->":
            if not path.is_symlink():
                path.symlink_to(unit_dir / units.UMBRELLA)
        else:
            path.write_text(text)
    try:
        if state is not None:
            write_state(state, listens)
    except OSError as exc:
        log(f"cannot record the sockets' addresses in {state} ({exc}); a later daemon-reload may close "
            "a running model's socket if its config is broken or its listen: changed")
    return done


def dry_run(unit_dir: Path) -> int:
    """Print what generate() would write, and write nothing."""
    files, _, _ = plan(state=state_dir())
    for rel, text in files.items():
        if text == "->":
            print(f"# {rel} -> {unit_dir / units.UMBRELLA}\n")
        else:
            print(f"# {rel}\n{text}")
    return 0


USAGE = "usage: hostd-generator [NORMAL_DIR [EARLY_DIR LATE_DIR]] | --dry-run"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unit_dir = Path(os.environ.get(UNIT_DIR_ENV, "/usr/local/lib/systemd/system"))
    if argv and argv[0] in ("--dry-run", "--dryrun"):
        return dry_run(unit_dir)
    if any(a.startswith("-") for a in argv):  # never a directory named like an option
        print(f"hostd-generator: unknown option {next(a for a in argv if a.startswith('-'))}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        normal_dir = Path(argv[0]) if argv else Path("/run/systemd/generator")
        generate(normal_dir, unit_dir, state=state_dir())
    except Exception as exc:  # never fail the boot
        log(f"failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
