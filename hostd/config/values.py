"""The rules for the strings a model config holds: its name, its public
address, and control characters in any value passed on.

One job: say, without any other part of the schema, why a string cannot be
used (None when it can); the schema's validators (schema.py), the loader
and the account checks (hostd/accounts.py) ask these.

Trust: the strings are the administrator's, but some reach unit files,
environment blocks and command lines run as root: a problem never echoes a
value whole (it may be a secret).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional

from hostd import paths, units

MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MODEL_NAME_RULE = (
    "letters, digits, '_', '.', '-', starting with a letter or digit, "
    f"at most {paths.max_model_name_length()} characters "
    "(so every socket path under /run/hostd/NAME/ fits the 108-byte limit)"
)


def model_name_problem(name: str) -> Optional[str]:
    """Why NAME cannot be a model name, or None when it can."""
    if not MODEL_NAME_RE.fullmatch(name):
        return f"model name {name!r} is not allowed: use {MODEL_NAME_RULE}"
    if len(name) > paths.max_model_name_length():
        return (
            f"model name {name!r} is {len(name)} characters long: "
            f"use {MODEL_NAME_RULE}"
        )
    if name in paths.RESERVED_NAMES:
        return f"model name {name!r} is reserved: {paths.RESERVED_NAMES[name]}; choose another name"
    problem = units.user_problem(name)
    if problem:
        return f"model name {name!r} is reserved: {problem}; choose another name"
    return None


def control_character_problem(key: str, value: str) -> Optional[str]:
    """Why VALUE cannot be used for KEY: a control character. Such strings reach
    unit files (a newline there starts a new setting, e.g. an ExecStartPre= run
    as root), environment blocks and command lines, so every string a model
    config passes on is refused with one, not escaped. The problem names the
    key, the character and its position, never the value: it may be a secret
    (an env: token), and the problem reaches ConfigProblem (any local user),
    the generator's 0644 drop-in and the journal."""
    for i, c in enumerate(value):
        if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
            return (f"{key}: the value contains the control character U+{ord(c):04X} ({c!r}) at position {i} "
                    f"of {len(value)}; remove it (a YAML '|' block ends with a newline, '|-' does not)")
    return None


def refuse_control_characters(strings: list[tuple[str, str]]) -> None:
    """Raise ValueError for the first (key, value) whose value has a control character."""
    for key, value in strings:
        problem = control_character_problem(key, value)
        if problem:
            raise ValueError(problem)


def listen_address_problem(listen: str) -> Optional[str]:
    """Why LISTEN is not a usable public address, or None."""
    if listen.startswith("/"):
        if len(listen.encode()) > paths.SUN_PATH_MAX:
            return f"{listen!r} is longer than {paths.SUN_PATH_MAX} bytes"
        return None
    host, sep, port = listen.rpartition(":")
    if not sep:
        port = listen
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return (
            f"{listen!r} has no port from 1 to 65535; use 'PORT', 'HOST:PORT', "
            "'[IPv6]:PORT' or an absolute socket path"
        )
    if host.startswith("[") != host.endswith("]"):
        return f"{listen!r}: an IPv6 host must be written in brackets, [::1]:PORT"
    return None


# The hosts gateway.metrics_listen may name: it serves /metrics with no key
# check, so anything a remote client can reach is refused (a name such as
# localhost is refused too: what it resolves to is /etc/hosts', not ours).
LOOPBACK_HOSTS = ("127.0.0.1", "[::1]")


def metrics_listen_problem(listen: str, token: bool = False) -> Optional[str]:
    """Why LISTEN cannot be gateway.metrics_listen (a Unix socket path or a
    loopback HOST:PORT; with a TOKEN file, HOST may be any IP address of the
    host, 0.0.0.0 and [::] included), or None."""
    if listen.startswith("/"):
        if any(c.isspace() or c in "\"'\\" for c in listen):
            # The generator names its directory in ReadWritePaths=, a list split at spaces.
            return f"{listen!r}: a Unix socket path here may hold no space, quote or backslash"
        return listen_address_problem(listen)
    host, _, port = listen.rpartition(":")
    if token:
        choices = "'ADDRESS:PORT' (an IPv4 address, or an IPv6 one in brackets) or an absolute Unix socket path"
        if not _ip_literal(host):
            return f"{listen!r}: the host must be an IP address (a name resolves as /etc/hosts says); use {choices}"
    else:
        choices = " or ".join(f"'{h}:PORT'" for h in LOOPBACK_HOSTS) + " or an absolute Unix socket path"
        if host not in LOOPBACK_HOSTS:
            return (f"{listen!r} is not a loopback address: without gateway.metrics_token the metrics listener "
                    f"checks no key, so it listens only on {choices}; set metrics_token (a file of bearer "
                    "tokens, as Prometheus's authorization: credentials_file sends them) to bind another address")
    if listen_address_problem(listen):
        return f"{listen!r} has no port from 1 to 65535; use {choices}"
    return None


def _ip_literal(host: str) -> bool:
    """Is HOST an IPv4 address, or an IPv6 one in brackets?"""
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        return False
    return bracketed == (address.version == 6)
