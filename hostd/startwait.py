"""`systemctl start model@NAME` returns when the model serves, or fails naming why.

One job: model@.service's ExecStartPost=. The gateway sends READY=1 as soon
as it accepts connections (it must: model@.service only Wants= the engine, so
that engine restarts never restart the gateway), which alone would let
`systemctl start` return 0 for a model whose engine cannot start. This waits
until the gateway reports `serving` (its control socket's status: the engine
answered /health), and exits 1 as soon as the model's engine or weights unit
has failed, printing the unit, how it ended and its last own log line; the
umbrella's start then fails with that line in its journal and
`systemctl status`. The unit's start timeout (TimeoutStartSec=) bounds the
wait: systemd kills this command when it passes.

Trust: run as root ("+" in the unit), outside the sandbox, to read the
model's units' journal; it only reads: the gateway's control socket through
sockets.connect (control.call), `systemctl show` and `journalctl`.
It polls (every POLL seconds) rather than subscribing to systemd's signals:
it lives for one start only and reads a handful of properties.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Optional

from hostd import paths, units
from hostd.gateway import control

POLL = 0.2  # seconds between looks
FAILED_SUBSTATES = {"failed", "auto-restart"}


def unit_state(unit: str) -> dict[str, str]:
    out = subprocess.run(
        ["systemctl", "show", "-p", "ActiveState", "-p", "SubState", "-p", "Result", "-p", "ExecMainStatus", unit],
        capture_output=True, text=True, timeout=30,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def last_error(unit: str) -> str:
    """The last line UNIT's own processes logged (not systemd's about it)."""
    out = subprocess.run(
        ["journalctl", "--no-pager", "-o", "json", "-n", "200", "-u", unit],
        capture_output=True, text=True, timeout=30,
    ).stdout
    for line in reversed(out.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("_PID") == "1" or entry.get("SYSLOG_IDENTIFIER") == "systemd":
            continue
        message = entry.get("MESSAGE")
        if isinstance(message, str) and message.strip():
            return " ".join(message.split())[:500]
    return "(it logged nothing)"


def failed_unit(name: str) -> Optional[str]:
    """The first of NAME's weights and engine units that has failed, described; None if none has."""
    for unit in (units.weights(name), units.engine(name)):
        state = unit_state(unit)
        if state.get("ActiveState") == "failed" or state.get("SubState") in FAILED_SUBSTATES:
            return (f"{unit} failed ({state.get('Result', '?')}, exit status {state.get('ExecMainStatus', '?')}, "
                    f"now {state.get('ActiveState')}/{state.get('SubState')}): {last_error(unit)}")
    return None


def gateway_state(name: str) -> Optional[str]:
    try:
        return control.call(paths.control_socket(name), control.Status()).state
    except (control.ControlError, OSError, AttributeError):
        return None  # not answering yet


def wait(name: str) -> int:
    while True:
        if gateway_state(name) == "serving":
            return 0
        problem = failed_unit(name)
        if problem is not None:
            print(f"hostd: model {name} cannot serve: {problem}; see journalctl -u 'model*@{name}.service'",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hostd.startwait NAME", file=sys.stderr)
        return 2
    return wait(argv[0])


if __name__ == "__main__":
    sys.exit(main())
