"""A model's log levels at run time: which processes a level goes to, and
sending it (Model.SetLogLevel in model_bus.py exports this; `hostctl
log-level` calls it).

One job: for model NAME and a role (gateway, engine, weights, manager; none:
the model's own processes, the manager not), find the units whose main
process plays it and send each the level's signal (hostd/logs.py's
LEVEL_SIGNALS) through systemd's KillUnit, main process only: a vLLM or
SGLang child under an engine or weights supervisor is not signalled (it
would die of it) and keeps upstream's own level, which only a restart
changes. The manager's own level is set in this process.

Trust: the caller was allowed the polkit action org.hostd1.log-level
(authority.admin). Only units that are active get the signal: their
process sent READY=1, long after it installed the handler, and a process
that is still starting would die of the signal's default action. Nothing is
written: a level set here lasts for the processes that took it; their next
start reads hostd.yaml's log_level.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hostd import logs, units
from hostd.manager import api, errors

log = logging.getLogger("hostd.manager")

ROLES = api.LOG_ROLES
# A model's own roles: the manager is one process for every model, changed
# only when named, never by a model's "all".
MODEL_ROLES = tuple(role for role in ROLES if role != "manager")


@dataclass(frozen=True)
class Changed:
    """One process that took the level: its role, its unit, its PID."""

    role: str
    unit: str
    pid: int


def role_units(name: str, role: str) -> list[str]:
    """The units of model NAME whose main process plays ROLE (every engine slot for "engine")."""
    return {"gateway": [units.umbrella(name)],
            "engine": [units.engine(name, slot) for slot in units.ENGINES],
            "weights": [units.weights(name)]}[role]


def check(role: str, level: str) -> None:
    """Refuse (InvalidValue) a ROLE or LEVEL that is not one of ours, naming what is."""
    if level not in logs.LEVEL_SIGNALS:
        raise errors.InvalidValue(f"log level {level!r} is not one of {', '.join(logs.LEVEL_SIGNALS)} "
                                  "(hostd.yaml's log_level values)")
    if role and role not in ROLES:
        raise errors.InvalidValue(f"role {role!r} is not one of {', '.join(ROLES)} "
                                  "(or empty: all of the model's processes)")


async def running(systemd, name: str, role: str) -> list[Changed]:
    """The processes of model NAME that would take a level for ROLE ("": the
    model's own): those of its units that are active, with their main PID."""
    found = []
    for each in (MODEL_ROLES if not role else (role,)):
        for unit in role_units(name, each):
            props = await systemd.properties(unit)
            pid = int(props.get("MainPID", 0) or 0)
            if props.get("ActiveState") == "active" and pid:
                found.append(Changed(each, unit, pid))
    return found


async def set_level(systemd, name: str, role: str, level: str) -> list[Changed]:
    """LEVEL in model NAME's processes of ROLE now; the processes that took it.
    Refused, changing nothing, for an unknown role or level and when none of
    them runs (NotRunning)."""
    check(role, level)
    if role == "manager":
        logs.set_level(level, f"Model.SetLogLevel for model {name} (every model's manager lines)")
        return [Changed("manager", units.MANAGER, os.getpid())]
    targets = await running(systemd, name, role)
    if not targets:
        what = f"no {role} process" if role else "no process"
        raise errors.NotRunning(f"model {name} has {what} running to take a log level: "
                                f"start it (systemctl start {units.umbrella(name)}); "
                                "a process takes hostd.yaml's log_level when it starts")
    signum = logs.level_signal(level)
    for target in targets:
        await systemd.kill(target.unit, signum)
    log.info("model %s: log level %s sent to %s", name, level,
             ", ".join(f"{t.role} (PID {t.pid})" for t in targets), extra={"hostd_model": name})
    return targets
