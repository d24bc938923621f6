"""hostd's D-Bus contract: the names the manager (service.py) exports and
hostd.client / hostctl call. One place, so the two sides cannot drift.

Only constants and pure helpers: the client imports this module without
pulling in the manager.
"""

from __future__ import annotations

BUS_NAME = "org.hostd1"
ROOT_PATH = "/org/hostd1"
MANAGER = "org.hostd1.Manager"
MODEL = "org.hostd1.Model"
OPERATION = "org.hostd1.Operation"
ERROR = "org.hostd1.Error"
PROPERTIES = "org.freedesktop.DBus.Properties"
ACCESS_DENIED = "org.freedesktop.DBus.Error.AccessDenied"

# polkit actions (packaging/org.hostd1.policy): what each allows. Only the
# actions a method asks for (authority.admin): the policy ships no other.
# CheckReload asks none: it changes nothing (authority.anyone; docs/dbus-api.md says why).
ACTIONS = {
    "org.hostd1.reload": "reload a model (Reload, ReloadJSON, Model.Reload)",
    "org.hostd1.manage": "start, stop or restart a model, or cancel its operation",
    # Its own action, not reload's: a level changes no config, and a site may
    # grant it to whoever reads the journal (it costs only journal space).
    "org.hostd1.log-level": "change the log level of a model's running processes (Model.SetLogLevel)",
}
RELOAD_ACTION, MANAGE_ACTION, LOG_LEVEL_ACTION = ACTIONS
# The polkit detail `verb` of each mutating method, and the action it asks
# for (authority.admin passes both): Access asks polkit once per verb, as the
# method would, since a rule may grant one verb of an action and not another
# (`stop` and not `start`); asking every verb as `start` told a page the
# wrong answer for the others.
VERB_ACTIONS = {
    "reload": RELOAD_ACTION,  # Reload, ReloadJSON, Model.Reload
    "revert": RELOAD_ACTION,  # Revert: the manager's drop-ins removed, then a reload
    "start": MANAGE_ACTION,
    "stop": MANAGE_ACTION,
    "restart": MANAGE_ACTION,
    "cancel": MANAGE_ACTION,  # Operation.Cancel
    "log-level": LOG_LEVEL_ACTION,  # Model.SetLogLevel
}

# Model.SetLogLevel's roles (manager/log_levels.py finds their processes);
# "" means the model's own: all of these but the manager, which serves every
# model and changes only when named.
LOG_ROLES = ("gateway", "engine", "weights", "manager")

MODEL_PATH = f"{ROOT_PATH}/model"
OPERATION_PATH = f"{ROOT_PATH}/operation"

# An Operation's State while it runs, and the states it ends in.
RUNNING = "running"
FINAL_STATES = ("done", "unchanged", "rolled-back", "failed", "cancelled")
# The final states in which the model runs what was asked for (hostctl exits 0).
SUCCESS_STATES = ("done", "unchanged")

# Finished operations the manager keeps on the bus (systemd's importd keeps 64
# transfers); older ones are removed with OperationRemoved.
KEEP_OPERATIONS = 64


def escape(name: str) -> str:
    """A model name as one D-Bus object path element (like systemd's escaping)."""
    return "".join(c if c.isalnum() and c.isascii() else f"_{ord(c):02x}" for c in name)


def model_path(name: str) -> str:
    return f"{MODEL_PATH}/{escape(name)}"


def operation_path(op_id: int) -> str:
    return f"{OPERATION_PATH}/{op_id}"


def error_name(kind: str) -> str:
    """org.hostd1.Error.KIND (NoSuchModel, NotEditable, InvalidValue, Busy, ...)."""
    return f"{ERROR}.{kind}"
