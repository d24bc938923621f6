"""The names of each model's systemd units.

One job: name the units, as hostd/paths.py names the sockets. The unit
templates in units/ are the other side of these names; everything in hostd/
that talks to systemd, writes a generator drop-in or tells an administrator
what to type takes the name from here.
"""

from __future__ import annotations

import hashlib
import re

UMBRELLA = "model@.service"  # the gateway, and the unit an administrator starts
SOCKET = "model@.socket"
ENGINE = "model-engine@.service"
# The second engine slot: started only by an overlap reload, beside ENGINE, and
# stopped once ENGINE serves the new config again (docs/operations.md).
ENGINE_NEXT = "model-engine-next@.service"
# The warm standby (`standby: true`, builtin): attached to the same weights
# with the committed config, serving nothing until a reload rebuilds it on the
# new config or the main engine dies (docs/operations.md, The standby engine).
ENGINE_STANDBY = "model-engine-standby@.service"
ENGINES = {"main": ENGINE, "next": ENGINE_NEXT, "standby": ENGINE_STANDBY}
# The pre-imported spare (`spare: true`, builtin): torch and the model's code
# imported, nothing else; each start of ENGINE forks its process from it
# (hostd/engine/spare.py). Not an engine slot: it serves nothing.
ENGINE_SPARE = "model-engine-spare@.service"
WEIGHTS = "model-weights@.service"
WEIGHTS_SOCKET = "model-weights@.socket"
# A checkpoint swap (a reload that changes `model:`): a second weight cache
# daemon loads the new checkpoint beside WEIGHTS, and an engine on it serves in
# the second slot while the main pair restarts on it (docs/operations.md).
WEIGHTS_NEXT = "model-weights-next@.service"
WEIGHTS_NEXT_SOCKET = "model-weights-next@.socket"
ENGINE_SWAP = "model-engine-swap@.service"
MANAGER = "hostd.service"


def instance(template: str, name: str) -> str:
    """TEMPLATE ("model@.service") instantiated for model NAME."""
    prefix, _, suffix = template.partition("@")
    return f"{prefix}@{name}{suffix}"


USER_PREFIX = "hostd-"
USER_MAX = 31  # systemd's limit on user names (and utmp's)
_USER_SAFE = re.compile(r"[a-z0-9_-]+")
# The shape of a hashed user name's end: a plain name of this shape would be
# another model's hashed one ("tiny-37616f64" and "Tiny"), so it is hashed too.
_HASHED_END = re.compile(r".*-[0-9a-f]{8}")

# Accounts hostd creates for itself (packaging/sysusers.conf), never a model's:
# a model whose user took one of these names would get that account's powers.
RESERVED_ACCOUNTS = {
    # the shared fallback service user: owns /var/lib/hostd
    "hostd": "the shared service user (packaging/sysusers.conf)",
    # the default admin group: systemd-sysusers makes an existing group of the
    # user's name its primary group, and polkit's isInGroup("hostd-admin") then
    # grants every org.hostd1 action to that model's processes
    "hostd-admin": "the group whose members may reload, start and stop models",
}


def user(name: str) -> str:
    """The system user model NAME's units run as: one per model, so that one
    model's processes cannot reach another's sockets, weights, processes or
    state. hostd-NAME when that is a valid user name of at most 31
    characters that cannot be another name's hashed form; else a readable
    prefix and a hash of the exact NAME (model names may hold '.' and
    capitals, which user names may not). Distinct names give distinct users
    (up to the 32-bit hash, which the loader checks: config.load)."""
    plain = USER_PREFIX + name
    if _USER_SAFE.fullmatch(name) and len(plain) <= USER_MAX and not _HASHED_END.fullmatch(name):
        return plain
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9_-]", "_", name.lower())
    return f"{USER_PREFIX}{readable[:USER_MAX - len(USER_PREFIX) - 9]}-{digest}"


def user_problem(name: str, admin_group: str = "hostd-admin") -> str | None:
    """Why model NAME's user name would take an account that is not its own
    (one of hostd's, or ADMIN_GROUP, the admin group hostd.yaml names), or None."""
    account = user(name)
    if account in RESERVED_ACCOUNTS:
        return f"its user would be {account}, {RESERVED_ACCOUNTS[account]}"
    if account == admin_group:
        return f"its user would be {account}, the admin_group of hostd.yaml"
    return None


def umbrella(name: str) -> str:
    return instance(UMBRELLA, name)


def socket(name: str) -> str:
    return instance(SOCKET, name)


def engine(name: str, slot: str = "main") -> str:
    return instance(ENGINES[slot], name)


def weights(name: str, slot: str = "main") -> str:
    """The weight cache daemon of SLOT: main, or next (a checkpoint swap's)."""
    return instance(WEIGHTS_NEXT if slot == "next" else WEIGHTS, name)


def weights_socket(name: str, slot: str = "main") -> str:
    return instance(WEIGHTS_NEXT_SOCKET if slot == "next" else WEIGHTS_SOCKET, name)


def spare(name: str) -> str:
    """The pre-imported spare that model NAME's main engine forks from."""
    return instance(ENGINE_SPARE, name)


def swap_engine(name: str) -> str:
    """The checkpoint swap's engine: the second slot, on the next weights."""
    return instance(ENGINE_SWAP, name)


def journal_units(name: str) -> list[str]:
    """The units whose journal lines speak for model NAME: its own (every
    engine slot) and the manager's. journald sets _SYSTEMD_UNIT= itself from
    the writer's cgroup, while HOSTD_MODEL= is a field anyone may write
    (`logger --journald`, systemd-cat): a reader of one model's journal
    (hostctl logs, the Cockpit page) matches both, so a line a local user
    forged with HOSTD_MODEL=NAME is not shown as the model's."""
    return [umbrella(name), socket(name), *(engine(name, slot) for slot in ENGINES), swap_engine(name), spare(name),
            weights(name), weights_socket(name), weights(name, "next"), weights_socket(name, "next"), MANAGER]
