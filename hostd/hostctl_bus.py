"""hostctl's commands that talk to the manager (org.hostd1) over the system
bus through hostd.client: reload (and `reload --check`: only the manager can
preflight a reload, and the check changes nothing there), list, status,
is-active, operations, cancel, start, stop, restart and log-level; and the
one line and exit code a D-Bus error becomes.

Trusts the manager's answers for what they say (states, stages, whether
Cancel is honoured now: hostctl keeps no table of its own) and nothing
beyond the bus daemon's word for who the manager is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Optional

import yaml
from dbus_fast.errors import DBusError

from hostd import units
from hostd.hostctl_output import (EXIT_FAILED, EXIT_NO_SUCH_MODEL, EXIT_NOT_RUNNING, EXIT_USAGE, emit_json,
                                  snake_keys, table)
from hostd.manager import api

# D-Bus error name -> exit code (systemctl's: 4 "no such unit", 3 "not active").
EXIT_CODES = {
    "org.hostd1.Error.NoSuchModel": EXIT_NO_SUCH_MODEL,
    "org.hostd1.Error.NotRunning": EXIT_NOT_RUNNING,
}
# Model states drawn as not running (the hollow dot of `hostctl status NAME`).
NOT_RUNNING = ("stopped", "failed", "unknown")
# The states in which a model answers requests: `status NAME` and `is-active`
# exit 0 in these, 3 (systemctl: "not active") in every other. A reload
# serves throughout (overlap) or answers 503 with Retry-After (restart): it
# is active, as systemctl calls a unit that reloads.
SERVING = ("serving", "reloading")
# The stages that wait on an engine's (or the swap's weight daemon's) start: the
# progress line shows its STATUS= (Operation.EngineStatus: upstream's phases too).
ENGINE_STAGES = ("restart", "start-next", "load-next", "rebuild")


def _client():
    from hostd.client import Client

    return Client()


def dbus_error(exc: Exception) -> int:
    """One line for a D-Bus error; its exit code."""
    name = getattr(exc, "type", type(exc).__name__)
    text = getattr(exc, "text", str(exc))
    if name in ("org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner"):
        text = (f"the manager ({units.MANAGER}, org.hostd1) is not running and could not be started: "
                f"is hostd installed (hostd install)? See journalctl -u {units.MANAGER}")
    elif name == "org.freedesktop.DBus.Error.AccessDenied":
        text = f"permission denied: {text} (changing models takes root or the hostd-admin group)"
    elif name.startswith("org.hostd1.Error."):
        text = f"{name.rsplit('.', 1)[1]}: {text}"
    else:
        text = f"{name}: {text}"
    print(f"hostctl: {text}", file=sys.stderr)
    return EXIT_CODES.get(name, EXIT_FAILED)


def parse_assignments(pairs: list[str]) -> dict:
    """key=value words -> patch; values are YAML scalars (16, 0.5, true, null)."""
    patch = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"hostctl: {pair!r} is not KEY=VALUE")
        patch[key] = yaml.safe_load(value) if value else ""
    return patch


def stage_facts(op: dict) -> list[str]:
    """Where an operation's Stage stands on its strategy's path (Stages) and
    whether Cancel() would be honoured now (Cancellable): the manager's
    words, never a table of hostctl's."""
    stage, path = op.get("Stage"), op.get("Stages") or []
    return ([f"{path.index(stage) + 1} of {len(path)}"] if stage in path else []) + \
        (["cancellable"] if op.get("Cancellable") else [])


class Progress:
    """A reload's stages as they happen. On a terminal: one line redrawn four
    times a second with the stage's elapsed time and, in a stage that waits on
    an engine (ENGINE_STAGES), that engine's STATUS=; otherwise a plain line
    per change."""

    def __init__(self, name: str, stream=sys.stderr):
        import threading

        self.name, self.stream = name, stream
        self.tty = stream.isatty()
        self.props: dict = {}
        self.started = time.monotonic()
        self._last_line = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True) if self.tty else None

    def __enter__(self) -> "Progress":
        if self._ticker:
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker:
            self._ticker.join()
            self.stream.write("\r\033[K")
            self.stream.flush()

    def line(self) -> str:
        props = self.props
        stage_s = max(0.0, time.time() - props.get("StageUSec", 0) / 1e6) if props.get("StageUSec") else 0.0
        strategy = f" (strategy {props['Strategy']})" if props.get("Strategy") else ""
        facts = ", ".join([f"{stage_s:.1f} s", *stage_facts(props)])
        text = f"reload {props.get('Id', '?')} of {self.name}{strategy}: {props.get('Stage', '...')} ({facts})"
        if props.get("Stage") in ENGINE_STAGES and props.get("EngineStatus"):
            text += f", engine: {props['EngineStatus']}"
        return text + f"  [{time.monotonic() - self.started:.1f} s]"

    def __call__(self, props: dict) -> None:
        with self._lock:
            self.props = dict(props)
            if self.tty:
                self._draw()
                return
            key = (props.get("Stage"), props.get("EngineStatus") if props.get("Stage") in ENGINE_STAGES else "")
            if key != self._last_line:
                self._last_line = key
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def _draw(self) -> None:
        self.stream.write("\r\033[K" + self.line())
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                if self.props:
                    self._draw()


def _value(value) -> str:
    return json.dumps(value)


def cmd_reload_check(args: argparse.Namespace, patch: dict) -> int:
    """`reload --check`: what the reload would do (the manager's
    CheckReload), nothing changed. Exit 0 when it would reload or nothing
    changes; a refusal exits as the reload's would (1, 3 not running, 4 no
    such model), its one line on stderr and, with --json, on stdout too."""
    try:
        with _client() as hostd:
            verdict = hostd.check_reload(args.name, patch)
    except DBusError as exc:
        if args.json:
            emit_json(args, {"model": args.name, "outcome": "refused", "patch": patch,
                             "error": exc.type, "message": exc.text}, ok=False)
        return dbus_error(exc)
    if args.json:
        emit_json(args, verdict)
        return 0
    changes = verdict["changes"]
    if verdict["outcome"] == "unchanged":
        print(f"reload of {args.name} would be unchanged: {verdict['reason']}")
        return 0
    count = f"{len(changes)} change{'s' if len(changes) != 1 else ''}" if changes else \
        "no change to what the engine reports"
    print(f"reload of {args.name} would apply {count} (strategy {verdict['strategy']}: {verdict['reason']})")
    for key, change in changes.items():
        print(f"  {key}: {_value(change['old'])} -> {_value(change['new'])}")
    if verdict.get("weights_not_retained"):
        print(f"  weights: not retained ({verdict['weights_not_retained']}): the engine would load them from disk")
    for note in verdict.get("notes", []):
        print(f"  note: {note}")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    patch = parse_assignments(args.assignments)
    if args.check:
        if args.no_wait:
            print("hostctl reload: --check changes nothing and starts no operation to wait for; "
                  "drop --no-wait", file=sys.stderr)
            return EXIT_USAGE
        return cmd_reload_check(args, patch)
    progress = Progress(args.name) if not (args.quiet or args.json) else None
    path = result = None
    last: dict = {}  # the operation as last seen

    def seen(props: dict) -> None:
        last.update(props)
        if progress:
            progress(props)
    with _client() as hostd, (progress or contextlib.nullcontext()):
        path = hostd.reload(args.name, patch, wait=False)["path"]
        if args.no_wait:
            print(path)
            return 0
        try:
            result = {"path": path, **hostd.wait(path, on_change=seen)}
        except KeyboardInterrupt:  # the manager runs the reload, not us: say so (importctl's way)
            pass
    if result is None:
        op_id = path.rsplit("/", 1)[-1]
        cancel = (f"`hostctl cancel {op_id}` cancels it now" if last.get("Cancellable") else
                  f"it is past what `hostctl cancel {op_id}` may end" if last else
                  f"`hostctl cancel {op_id}` cancels it while its Cancellable property is true")
        print(f"hostctl: reload {op_id} of {args.name} continues in the background; "
              f"{cancel}, `hostctl status {args.name}` shows how it ends", file=sys.stderr)
        return 130
    state = result["State"]
    if args.json:
        emit_json(args, snake_keys(result), ok=state in api.SUCCESS_STATES)
        return 0 if state in api.SUCCESS_STATES else 1
    took = (result.get("FinishedUSec", 0) - result.get("CreatedUSec", 0)) / 1e6
    line = f"reload of {args.name}: {state}"
    facts = [f"strategy {result['Strategy']}"] if result.get("Strategy") else []
    if result.get("WeightsReused"):
        facts.append("weights reused")
    if facts:
        line += f" ({', '.join(facts)})"
    if took > 0:
        line += f" in {took:.1f} s"
    if result.get("Error"):
        line += f": {result['Error']}"
    for note in result.get("Notes", []):
        line += f"; {note}"
    ok = state in api.SUCCESS_STATES
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_list(args: argparse.Namespace) -> int:
    """The manager's models and states, and why a config does not load (the
    manager's word, Model.ConfigProblem: it reads files a user cannot)."""
    with _client() as hostd:
        models = hostd.list_models()
        # The first problem, on one line (all of them: hostctl config NAME).
        problems = {m["name"]: " ".join(hostd.config_problem(m["path"]).split("\n")[0].split()) for m in models}
    if args.json:
        emit_json(args, [{"name": m["name"], "state": m["state"], "config_problem": problems[m["name"]]}
                         for m in models])
        return 0
    table(args, ["MODEL", "STATE", "CONFIG"],
          [[m["name"], m["state"], f"invalid: {problems[m['name']]}" if problems[m["name"]] else "ok"]
           for m in models])
    return 0


def _ago(usec: int) -> str:
    seconds = max(0.0, time.time() - usec / 1e6)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def last_operation(hostd, props: dict) -> Optional[dict]:
    path = props.get("LastOperation", "/")
    return hostd.operation(path) if path and path != "/" else None


def describe_operation(op: Optional[dict]) -> str:
    if not op:
        return "-"
    text = f"{op['Kind']} {op['Id']} {op['State']}"
    if op.get("Strategy"):
        text += f" (strategy {op['Strategy']})"
    if op.get("FinishedUSec"):
        text += f" in {(op['FinishedUSec'] - op['CreatedUSec']) / 1e6:.1f} s, {_ago(op['FinishedUSec'])}"
    else:
        text += f" (stage {', '.join([op['Stage'], *stage_facts(op)])})"
    return text


def model_summary(hostd, name: str, gpus: bool = True) -> dict:
    """A model's facts as hostctl status shows them (and --json prints them);
    GPUS: with its GPUs' NVML reading (status's table has no room for it)."""
    props = hostd.model(name)
    op = last_operation(hostd, props)
    return {
        "name": props["Name"], "state": props["State"], "backend": props["Backend"],
        "listen": props.get("Listen", ""), "units": props.get("Units", []),
        "gateway_pid": props.get("GatewayPID", 0), "engine_pid": props.get("EnginePID", 0),
        "weights_pid": props.get("WeightsPID", 0), "weights_retained": props.get("WeightsRetained", False),
        "weights_not_retained_reason": props.get("WeightsNotRetainedReason", ""),
        "engine_status": props.get("EngineStatus", ""), "in_flight": props["InFlight"],
        "standby": props.get("Standby", False), "standby_state": props.get("StandbyState", ""),
        "standby_pid": props.get("StandbyPID", 0), "start_problem": props.get("StartProblem", ""),
        "engine": props["Config"].get("engine", {}), "editable": props["EditableFields"],
        # The checkpoint that runs (RunningConfig: a swap's commit, or the
        # disk at the model's last start), else the one the config names.
        "checkpoint": (props.get("RunningConfig") or {}).get("fixed", {}).get("model")
        or props["Config"].get("model", ""),
        "last_operation": op and snake_keys({k: op.get(k) for k in (
            "Id", "Kind", "State", "Stage", "Strategy", "Error", "WeightsReused", "CreatedUSec", "FinishedUSec",
            "Stages", "Cancellable")}),
        "_last_operation_text": describe_operation(op),
        # Its GPUs as NVML names them now (Model.GpuMemory): index, UUID, MIG UUID, bytes.
        **({"gpus": gpu_memory(hostd, name)} if gpus else {}),
    }


def gpu_memory(hostd, name: str):
    """Model.GpuMemory's reading, or {"unreadable": why} when the call fails:
    status shows the rest of the model either way."""
    try:
        return hostd.gpu_memory(name)
    except DBusError as exc:  # the manager says why
        return {"unreadable": exc.text}


def _pid(pid: int) -> str:
    return str(pid) if pid else "-"


def cmd_status(args: argparse.Namespace) -> int:
    with _client() as hostd:
        names = [args.name] if args.name else [m["name"] for m in hostd.list_models()]
        models = [model_summary(hostd, name, gpus=bool(args.name or args.json)) for name in names]
    if args.json:
        data = [{k: v for k, v in m.items() if not k.startswith("_")} for m in models]
        emit_json(args, data[0] if args.name else data,
                  ok=not args.name or models[0]["state"] in SERVING)
    elif args.name:
        print_detail(models[0])
    else:
        table(args, ["MODEL", "STATE", "BACKEND", "LISTEN", "ENGINE", "WEIGHTS", "RETAINED", "LAST OPERATION"],
              [[m["name"], m["state"], m["backend"], m["listen"], _pid(m["engine_pid"]), _pid(m["weights_pid"]),
                "yes" if m["weights_retained"] else "no", m["_last_operation_text"]] for m in models])
    if args.name and models[0]["state"] not in SERVING:
        return EXIT_NOT_RUNNING
    return 0


def cmd_is_active(args: argparse.Namespace) -> int:
    """systemctl is-active's contract: the state on stdout, exit 0 only when
    the model serves (3 otherwise, 4 for no such model)."""
    with _client() as hostd:
        state = hostd.model(args.name)["State"]
    if not args.quiet:
        print(state)
    return 0 if state in SERVING else EXIT_NOT_RUNNING


def describe_gpus(gpus) -> str:
    """Model.GpuMemory's reading as status's GPUs row: a line a GPU."""
    if isinstance(gpus, dict):
        return f"unreadable ({gpus.get('unreadable', '')})"
    if not gpus:
        return "-"
    return "\n".join(f"{g['index']} {g.get('mig_uuid') or g.get('uuid') or ''}".rstrip()
                     + f": engine {g['engine'] >> 20} MiB, weights {g['weights'] >> 20} MiB, "
                     f"free {g['free'] >> 20} of {g['total'] >> 20} MiB" for g in gpus)


def print_detail(m: dict) -> None:
    """`hostctl status NAME`, laid out as systemctl status is."""
    dot = "●" if m["state"] not in NOT_RUNNING else "○"
    print(f"{dot} {m['name']} - {m['backend']} model, {m['state']}, {m['in_flight']} in flight")
    units_ = m["units"] or []
    pids = {0: m["gateway_pid"], 2: m["engine_pid"], 3: m["weights_pid"], 5: m.get("standby_pid", 0)}
    rows = [
        ("Listen", m["listen"] or "-"),
        ("Units", "\n".join(f"{u}" + (f" (PID {pids[i]})" if pids.get(i) else "") for i, u in enumerate(units_))),
        ("Weights", f"retained by PID {m['weights_pid']}" if m["weights_retained"] else
         f"not retained ({m['weights_not_retained_reason']})" if m["weights_not_retained_reason"] else "not retained"),
        ("Checkpoint", m.get("checkpoint") or "-"),
        ("Engine", m["engine_status"] or "-"),
        ("Standby", (f"{m['standby_state'] or 'unknown'}" + (f" (PID {m['standby_pid']})" if m.get("standby_pid") else ""))
         if m.get("standby") else "none (standby: false)"),
        ("GPUs", describe_gpus(m.get("gpus"))),
        ("Limits", json.dumps(m["engine"], sort_keys=True)),
        ("Editable", ", ".join(m["editable"]) or "-"),
        ("Last op", m["_last_operation_text"]),
    ]
    if m.get("start_problem"):  # the socket refuses to start the model (hostd/secretfiles.py)
        rows.insert(0, ("Refused", m["start_problem"]))
    for label, value in rows:
        first, *more = value.split("\n")
        print(f"{label:>10}: {first}")
        for extra in more:
            print(f"{'':>12}{extra}")


def cmd_operations(args: argparse.Namespace) -> int:
    with _client() as hostd:
        ops = hostd.operations()
    if args.json:
        emit_json(args, ops)
        return 0
    cells = [[op["id"], op["model"], op["kind"], op["state"], op["stage"]] for op in ops]
    table(args, ["ID", "MODEL", "KIND", "STATE", "STAGE"], cells)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client() as hostd:
        hostd.cancel(args.id)
    return 0


def cmd_unit_verb(args: argparse.Namespace) -> int:
    """start, stop, restart and revert: an Operation of the manager, waited
    for; with --no-block (systemctl's) only asked for: nothing is printed
    (--json: its path) and the exit code says only that it was accepted."""
    shown = [""]

    def engine_status(props: dict) -> None:
        """The engine's STATUS= lines while it starts (upstream's phases too), as systemctl shows none."""
        status = props.get("EngineStatus")
        if status and status != shown[0] and not args.json:
            shown[0] = status
            print(f"{args.command} {args.name}: engine: {status}", file=sys.stderr, flush=True)
    with _client() as hostd:
        result = getattr(hostd, args.command)(args.name, wait=not args.no_block, on_change=engine_status)
    if args.no_block:
        if args.json:
            emit_json(args, snake_keys(result))
        return 0
    ok = result["State"] in api.SUCCESS_STATES
    if args.json:
        emit_json(args, snake_keys(result), ok=ok)
        return 0 if ok else 1
    line = f"{args.command} {args.name}: {result['State']}{': ' + result['Error'] if result['Error'] else ''}"
    for note in result.get("Notes", []):  # revert's says what it removed
        line += f"; {note}"
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_is_failed(args: argparse.Namespace) -> int:
    """systemctl is-failed's contract: the state on stdout, exit 0 only when
    the model failed (its umbrella unit, or its engine past its restarts)."""
    with _client() as hostd:
        state = hostd.model(args.name)["State"]
    if not args.quiet:
        print(state)
    return 0 if state == "failed" else 1


def show_value(value) -> str:
    """One property's value as systemctl show prints it: booleans yes/no,
    lists of words space-separated, anything deeper as compact JSON."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return " ".join(str(v) for v in value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def cmd_show(args: argparse.Namespace) -> int:
    """systemctl show's contract over the model's D-Bus properties
    (org.hostd1.Model): NAME=VALUE lines, sorted by name; -p PROP (repeated or
    comma-separated) only those, a name the model lacks printing nothing
    (as systemctl); --value the values alone."""
    with _client() as hostd:
        props = hostd.model_properties(args.name)
    wanted = [p for arg in args.property for p in arg.split(",") if p]
    names = sorted(props) if not wanted else [p for p in wanted if p in props]
    if args.json:
        emit_json(args, snake_keys({name: props[name] for name in names}))
        return 0
    for name in names:
        print(show_value(props[name]) if args.value else f"{name}={show_value(props[name])}")
    return 0


def cmd_log_level(args: argparse.Namespace) -> int:
    """`log-level NAME [ROLE] LEVEL`: the manager's SetLogLevel; each process
    that took the level, with its PID (the same PID before and after: nothing
    restarts)."""
    with _client() as hostd:
        changed = hostd.set_log_level(args.name, args.role or "", args.level)
    if args.json:
        emit_json(args, [{**c, "level": args.level} for c in changed])
        return 0
    table(args, ["ROLE", "UNIT", "PID", "LEVEL"], [[c["role"], c["unit"], c["pid"], args.level] for c in changed])
    return 0
