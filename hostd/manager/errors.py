"""How the manager refuses, and how a refusal reaches a D-Bus caller.

One job: the manager's exception family (Refused and its kinds) and the one
table that turns hostd's exceptions into D-Bus errors (org.hostd1.Error.*).
Methods raise; the `replies` decorator maps (authority.admin, which checks
the caller first, maps through it too). A refusal changes nothing: it is
raised before any file, unit or gateway is touched.

Besides its own family the manager passes on two of hostd's refusals: the
config loader's (ConfigError; NoSuchModel for a name that is no model) and
a backend's (backends.BackendRefused).
"""

from __future__ import annotations

import functools
import logging

from dbus_fast.errors import DBusError

from hostd import backends
from hostd import config as hostd_config
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
    "Busy": "another operation runs on the model; or Cancel where the Operation is not Cancellable",
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


# hostd's refusals from outside the manager that reach a caller as they are
# (InvalidValue, or NoSuchModel for the loader's NoSuchModel): expected, so
# not logged as failures.
PASSED_ON = (hostd_config.ConfigError, backends.BackendRefused)


def to_dbus(exc: BaseException) -> DBusError:
    """The D-Bus error a caller sees for EXC (the one mapping)."""
    if isinstance(exc, DBusError):
        return exc
    if isinstance(exc, Refused):
        return DBusError(exc.error_name or api.error_name(exc.kind), str(exc))
    if isinstance(exc, hostd_config.NoSuchModel):  # the loader's name rule, or no NAME.yaml
        return DBusError(api.error_name(NoSuchModel.kind), str(exc.reason))
    if isinstance(exc, PASSED_ON):  # a bad file / what no engine could serve
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
            if not isinstance(exc, PASSED_ON):
                log.exception("%s failed", fn.__name__)
            raise to_dbus(exc) from None

    return wrapper
