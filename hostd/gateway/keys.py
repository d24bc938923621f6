"""API keys for the public port: who may use the model.

One job: load the model's bearer keys and check a request's Authorization
header against them. The keys live in a file the administrator owns (one key
per line; blank lines and lines starting with '#' are ignored), named by
`gateway.api_keys` in the model's YAML; the YAML never holds a key. Under
systemd the unit receives that file as the credential `api-keys`
(LoadCredential=, written by hostd-generator), so the service user reads it
from $CREDENTIALS_DIRECTORY and needs no access to the file itself; run by
hand, the gateway reads the configured path.

Trusts: nobody on the public port. Every configured key is compared with
hmac.compare_digest (constant time per key, and every key is compared, so
the time taken does not say which key came close). A model configured with
keys whose file cannot be read, or holds none, does not start: it never
falls back to serving without keys.

The engine and weights units run as the gateway's user (one uid per model)
and run upstream code fed by the network: they see no /run/credentials
(their units' TemporaryFileSystem=), and once the gateway holds keys it makes
itself non-dumpable, so that a process of the same uid cannot read them
through /proc/PID/root, /proc/PID/mem or ptrace either.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Optional

CREDENTIAL = "api-keys"


class KeysError(Exception):
    """The configured keys cannot be loaded; the message names the file."""


def keys_path(configured: str) -> Path:
    """Where this process reads the keys: systemd's credential when passed,
    else the configured file."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if directory and (Path(directory) / CREDENTIAL).exists():
        return Path(directory) / CREDENTIAL
    return Path(configured)


def load(configured: Optional[str]) -> Optional[list[bytes]]:
    """The keys (None when the model has no keys configured); KeysError when
    they are configured but cannot be used."""
    if not configured:
        return None
    path = keys_path(configured)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeysError(f"gateway.api_keys: cannot read the keys file {path}: {exc.strerror or exc}") from None
    keys = [line.strip().encode() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise KeysError(f"gateway.api_keys: {path} holds no key (one key per line)")
    not_inspectable()
    return keys


PR_SET_DUMPABLE = 4


def not_inspectable() -> None:
    """Make this process non-dumpable: its /proc/PID entries become root's and
    ptrace access needs CAP_SYS_PTRACE, which no model unit has."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: nothing to protect against here


def authorized(keys: list[bytes], header: Optional[str]) -> bool:
    """Does the Authorization HEADER carry one of KEYS as a bearer token?"""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # aiohttp decodes header bytes that are not UTF-8 as surrogates: encoded
    # back they are the bytes sent, which match no key (never an error).
    presented = token.strip().encode("utf-8", "surrogateescape")
    matches = [hmac.compare_digest(presented, key) for key in keys]  # all of them, always
    return any(matches)
