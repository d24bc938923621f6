"""How the manager refuses, and how a refusal reaches a D-Bus caller.

One job: the manager's exception family (Refused and its kinds) and the one
table that turns hostd's exceptions into D-Bus errors (org.hostd1.Error.*).
Methods raise; the `replies` decorator maps; `admin` checks the caller first.
A refusal changes nothing: it is raised before any file, unit or gateway is
touched.

Authorization (authorize): root may do everything without asking, as
systemd's services let privileged callers; anyone else is allowed what polkit
allows them (CheckAuthorization of the caller's bus name, no interaction):
packaging/org.hostd1.rules allows the admin group. Where polkit is absent
only root is allowed, and the journal says why.
"""

from __future__ import annotations

import functools
import logging

from dbus_fast import Message, MessageType, Variant
from dbus_fast.errors import DBusError

from hostd import backends
from hostd.config import ConfigError
from hostd.manager import api

log = logging.getLogger("hostd.manager")


class Refused(Exception):
    """The manager refused a request; nothing was changed. KIND is the last
    element of the D-Bus error name (org.hostd1.Error.KIND)."""

    kind = "Failed"
    error_name = ""  # a D-Bus error outside org.hostd1.Error, when set

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        if kind:
            self.kind = kind


# The kinds of refusal: the D-Bus error (org.hostd1.Error.KIND) and when it is raised.
KINDS = {
    "NoSuchModel": "no /etc/hostd/models/NAME.yaml",
    "NoSuchOperation": "GetOperation of an id that is not (or no longer) on the bus",
    "NotEditable": "a fixed field, a field the backend does not have, or fixed fields changed on disk",
    "InvalidValue": "a wrong type, out of range, refused by the backend, or overridden by a later drop-in",
    "Busy": "another operation runs on the model; or Cancel past the drain",
    "NotRunning": "the model is not started, or the operation already ended",
    "InsufficientMemory": "the GPU preflight says the new engine would not fit",
}
NoSuchModel, NoSuchOperation, NotEditable, InvalidValue, Busy, NotRunning, InsufficientMemory = (
    type(kind, (Refused,), {"kind": kind, "__doc__": when, "__module__": __name__})
    for kind, when in KINDS.items()
)


class AccessDenied(Refused):
    kind = "AccessDenied"
    error_name = api.ACCESS_DENIED


def to_dbus(exc: BaseException) -> DBusError:
    """The D-Bus error a caller sees for EXC (the one mapping)."""
    if isinstance(exc, DBusError):
        return exc
    if isinstance(exc, Refused):
        return DBusError(exc.error_name or api.error_name(exc.kind), str(exc))
    if isinstance(exc, (backends.Refused, ConfigError)):  # what no engine could serve / a bad file
        return DBusError(api.error_name(InvalidValue.kind), str(exc))
    return DBusError(api.error_name("Failed"), f"unexpected error: {exc}")


def replies(fn):
    """Run a D-Bus method; whatever it raises reaches the caller as a D-Bus error."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            return await result if hasattr(result, "__await__") else result
        except DBusError:
            raise
        except Refused as exc:
            raise to_dbus(exc) from None
        except Exception as exc:
            if not isinstance(exc, (backends.Refused, ConfigError)):
                log.exception("%s failed", fn.__name__)
            raise to_dbus(exc) from None

    return wrapper


POLKIT = ("org.freedesktop.PolicyKit1", "/org/freedesktop/PolicyKit1/Authority",
          "org.freedesktop.PolicyKit1.Authority")
# The errors that mean no polkit answers on this bus (not a "no").
POLKIT_ABSENT = ("org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner",
                 "org.freedesktop.DBus.Error.Spawn.")


async def authorize(bus, sender: str, uid: int, action: str, admin_group: str) -> None:
    """Raise AccessDenied unless the caller SENDER (uid UID) may do ACTION."""
    if uid == 0:
        return
    what = api.ACTIONS[action]
    reply = await bus.call(Message(
        destination=POLKIT[0], path=POLKIT[1], interface=POLKIT[2], member="CheckAuthorization",
        signature="(sa{sv})sa{ss}us",
        body=[["system-bus-name", {"name": Variant("s", sender)}], action, {}, 0, ""],
    ))
    if reply.message_type == MessageType.ERROR:
        if reply.error_name.startswith(POLKIT_ABSENT):
            log.warning("uid %d may not %s: polkit is not available (%s), so only root is allowed; "
                        "install polkitd to let the %r group", uid, what, reply.error_name, admin_group)
            raise AccessDenied(f"access denied: uid {uid} may not {what}: polkit is not running on this "
                               f"host, so only root may (install polkitd to allow the {admin_group!r} group)")
        log.error("polkit could not decide on %s for uid %d: %s %s", action, uid, reply.error_name, reply.body)
        raise AccessDenied(f"access denied: polkit could not decide on {action}: {reply.error_name}")
    authorized, _challenge, _details = reply.body[0]
    if not authorized:
        raise AccessDenied(f"access denied: uid {uid} is not authorized to {what} (polkit action {action}): "
                           f"only root and members of {admin_group!r} are")


def admin(action):
    """A mutating method that needs polkit ACTION (api.ACTIONS); the
    interface's `manager` asks (require_admin). Bare @admin means
    api.MANAGE_ACTION."""
    if callable(action):
        return admin(api.MANAGE_ACTION)(action)

    def decorate(fn):
        @functools.wraps(fn)
        async def wrapper(self, *args, **kwargs):
            await self.manager.require_admin(action)
            return await fn(self, *args, **kwargs)

        return replies(wrapper)

    return decorate
