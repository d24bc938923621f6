"""Who may call the manager's mutating methods: the one room that decides.

One job: for the D-Bus method being handled, find the caller (its unique bus
name, CallerAwareBus; its uid from the bus daemon, GetConnectionUnixUser,
never from the message), and allow or refuse the polkit action the method
needs (the `admin` decorator, Authority.require).

Trust: root may do everything without asking, as systemd's services let
privileged callers; anyone else is allowed what polkit allows them
(CheckAuthorization of the caller's bus name, no interaction):
packaging/org.hostd1.rules allows the admin group. Where polkit is absent only
root is allowed, and the journal says why. A call that is not a bus message
being handled (no caller) is refused.

Interfaces reach it as `self.authority` (an Authority); the manager, the
models and the operations share one.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Optional

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from hostd.manager import api
from hostd.manager.errors import AccessDenied, replies

log = logging.getLogger("hostd.manager")

CALLER: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("caller", default=None)

POLKIT = ("org.freedesktop.PolicyKit1", "/org/freedesktop/PolicyKit1/Authority",
          "org.freedesktop.PolicyKit1.Authority")
# The errors that mean no polkit answers on this bus (not a "no").
POLKIT_ABSENT = ("org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner",
                 "org.freedesktop.DBus.Error.Spawn.")


class CallerAwareBus(MessageBus):
    """Makes the sender of the method call being handled available in CALLER
    (dbus-fast does not pass it to method handlers)."""

    def _make_method_handler(self, interface, method_):
        inner = super()._make_method_handler(interface, method_)

        def handler(msg, send_reply):
            token = CALLER.set(msg.sender)
            try:
                return inner(msg, send_reply)
            finally:
                CALLER.reset(token)

        return handler


class Authority:
    """Asks the bus who the caller is and polkit whether it may."""

    def __init__(self, bus, admin_group: str = "hostd-admin"):
        self.bus, self.admin_group = bus, admin_group

    async def require(self, action: str, details: Optional[dict[str, str]] = None) -> None:
        """Raise AccessDenied unless the caller of the method being handled
        may do ACTION (api.ACTIONS). DETAILS go to polkit with it (`model`
        and `verb`, as systemd passes `unit` and `verb`), so that a rule may
        grant per model: action.lookup("model")."""
        sender = CALLER.get()
        if sender is None:
            raise AccessDenied("unknown caller")
        reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionUnixUser", signature="s", body=[sender],
        ))
        if reply.message_type == MessageType.ERROR:
            raise AccessDenied("cannot tell who the caller is")
        await self.authorize(sender, reply.body[0], action, details or {})

    async def authorize(self, sender: str, uid: int, action: str, details: Optional[dict[str, str]] = None) -> None:
        """Raise AccessDenied unless the caller SENDER (uid UID) may do ACTION (with DETAILS)."""
        if uid == 0:
            return
        what, group = api.ACTIONS[action], self.admin_group
        reply = await self.bus.call(Message(
            destination=POLKIT[0], path=POLKIT[1], interface=POLKIT[2], member="CheckAuthorization",
            signature="(sa{sv})sa{ss}us",
            body=[["system-bus-name", {"name": Variant("s", sender)}], action, dict(details or {}), 0, ""],
        ))
        if reply.message_type == MessageType.ERROR:
            if reply.error_name.startswith(POLKIT_ABSENT):
                log.warning("uid %d may not %s: polkit is not available (%s), so only root is allowed; "
                            "install polkitd to let the %r group", uid, what, reply.error_name, group)
                raise AccessDenied(f"access denied: uid {uid} may not {what}: polkit is not running on this "
                                   f"host, so only root may (install polkitd to allow the {group!r} group)")
            log.error("polkit could not decide on %s for uid %d: %s %s", action, uid, reply.error_name, reply.body)
            raise AccessDenied(f"access denied: polkit could not decide on {action}: {reply.error_name}")
        authorized, _challenge, _details = reply.body[0]
        if not authorized:
            raise AccessDenied(f"access denied: uid {uid} is not authorized to {what} (polkit action {action}): "
                               f"only root and members of {group!r} are")


# The polkit detail `verb` of each mutating method (its name lowercased otherwise).
VERBS = {"ReloadJSON": "reload", "SetLogLevel": "log-level"}


def _model_of(interface, args: tuple) -> str:
    """The model a mutating call acts on: a Model object's own, an
    Operation's, or the Manager's NAME argument."""
    if isinstance(getattr(interface, "model_name", None), str):
        return interface.model_name
    op = getattr(interface, "op", None)
    if op is not None:
        return op.model
    return args[0] if args and isinstance(args[0], str) else ""


async def access(authority: "Authority", name: str) -> dict[str, str]:
    """Each verb of api.VERB_ACTIONS -> "" when the caller of the method
    being handled may do it on model NAME, else the refusal the mutating
    method would give it (polkit asked as that method asks it: its action,
    the model and the verb, without interaction; nothing else is done).
    Each action of api.ACTIONS -> its first verb's refusal, or "" when every
    verb of it is allowed (Manager.Access)."""
    answer = {}
    for verb, action in api.VERB_ACTIONS.items():
        try:
            await authority.require(action, {"model": name, "verb": verb})
        except AccessDenied as exc:
            answer[verb] = str(exc)
        else:
            answer[verb] = ""
    for action in api.ACTIONS:
        answer[action] = next((answer[verb] for verb, of in api.VERB_ACTIONS.items()
                               if of == action and answer[verb]), "")
    return answer


def admin(action):
    """A mutating method that needs polkit ACTION (api.ACTIONS): the
    interface's `authority` is asked first; whatever is raised reaches the
    caller as a D-Bus error (errors.replies)."""

    def decorate(fn):
        verb = VERBS.get(fn.__name__, fn.__name__.lower())

        @functools.wraps(fn)
        async def wrapper(self, *args, **kwargs):
            await self.authority.require(action, {"model": _model_of(self, args), "verb": verb})
            return await fn(self, *args, **kwargs)

        return replies(wrapper)

    return decorate


def anyone(why: str):
    """A method any local user may call, without polkit, because WHY (it
    changes nothing): the rule for the read-only verbs, here with the
    others (CheckReload: a dry run of Reload, whose size cap, patch.py's,
    any caller meets first). Errors reach the caller as D-Bus errors
    (errors.replies)."""

    def decorate(fn):
        fn.__hostd_open__ = why  # what tests and readers find: open on purpose
        return replies(fn)

    return decorate
