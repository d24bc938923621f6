"""API keys for the public port: who may use the model.

One job: load the model's bearer keys and check a request's Authorization
header against them. The keys live in a file the administrator owns (one key
per line; blank lines and lines starting with '#' are ignored), named by
`gateway.api_keys` in the model's YAML; the YAML never holds a key. Under
systemd the unit receives that file as the credential `api-keys`
(LoadCredential=, written by hostd-generator), so the service user reads it
from $CREDENTIALS_DIRECTORY and needs no access to the file itself; run by
hand, the gateway reads the configured path.

A credential is copied once, when the unit starts. New keys reach a running
gateway through `systemctl reload model@NAME`: its first ExecReload= runs
`python -m hostd.gateway.keys NAME` (push, below) as root, which reads the
keys file named in the model's config on disk, as the loader reads files
(a regular file, size-capped), and hands the keys to the gateway over its
control socket (the verb `keys`, root's alone: control.py). The gateway
swaps its list at once: requests already admitted run on, the next one is
checked against the new keys. A file that cannot be read or holds no key
is refused, naming it, and the gateway keeps the keys it has. Keys on or off,
or another keys file, take `systemctl restart model@NAME` (the LoadCredential=
line changes). A later restart of the gateway reads the file again.

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

import argparse
import hmac
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MAX_KEYS_BYTES = 24 << 10  # a keys file's size cap (~480 keys of 51 characters): one control request
# (control.MAX_LINE, 64 KiB) carries its keys however short they are


@dataclass(frozen=True)
class KeysFile:
    """A file of bearer tokens the gateway checks: its key in the model's
    YAML (gateway.KEY, also the name of the Gateway's attribute holding its
    keys) and the systemd credential that brings it to the unit."""

    key: str
    credential: str
    what: str  # in the journal

    def configured(self, gateway_config) -> Optional[str]:
        return getattr(gateway_config, self.key)


API_KEYS = KeysFile("api_keys", "api-keys", "API keys")  # the public port's
METRICS_TOKEN = KeysFile("metrics_token", "metrics-token", "metrics tokens")  # gateway.metrics_listen's (metrics_listener.py)
KEYS_FILES = (API_KEYS, METRICS_TOKEN)
CREDENTIAL = API_KEYS.credential


class KeysError(Exception):
    """The configured keys cannot be loaded; the message names the file."""


def keys_path(configured: str, of: KeysFile = API_KEYS) -> Path:
    """Where this process reads the keys: systemd's credential when passed,
    else the configured file."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if directory and (Path(directory) / of.credential).exists():
        return Path(directory) / of.credential
    return Path(configured)


def read(path: Path, of: KeysFile = API_KEYS) -> list[str]:
    """The keys in the keys file PATH, one per line ('#' comments and blank
    lines skipped); KeysError naming PATH when it cannot be read as a regular
    UTF-8 file of at most MAX_KEYS_BYTES or holds no key. Opened as the
    loader opens config files: a FIFO cannot hang the reader."""
    from hostd.config.problems import ConfigError
    from hostd.config.yaml_files import read_regular_file

    try:
        data = read_regular_file(path, str(path))
        if len(data) > MAX_KEYS_BYTES:
            raise KeysError(f"gateway.{of.key}: the keys file {path} is larger than {MAX_KEYS_BYTES} bytes")
        text = data.decode("utf-8")
    except OSError as exc:
        raise KeysError(f"gateway.{of.key}: cannot read the keys file {path}: {exc.strerror or exc}") from None
    except ConfigError as exc:
        raise KeysError(f"gateway.{of.key}: cannot use the keys file {path}: {exc.problems[0].message}") from None
    except UnicodeDecodeError:
        raise KeysError(f"gateway.{of.key}: the keys file {path} is not UTF-8 text") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise KeysError(f"gateway.{of.key}: {path} holds no key (one key per line)")
    return keys


def encoded(keys: list[str]) -> list[bytes]:
    """KEYS as authorized() compares them."""
    return [key.encode() for key in keys]


def load(configured: Optional[str], of: KeysFile = API_KEYS) -> Optional[list[bytes]]:
    """The keys (None when the model has no keys configured); KeysError when
    they are configured but cannot be used."""
    if not configured:
        return None
    keys = encoded(read(keys_path(configured, of), of))
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


# ---------------------------------------------------------------- new keys for a running gateway


def push(name: str, root: Optional[Path] = None) -> str:
    """Hand model NAME's running gateway the keys now in each keys file its
    config on disk names (gateway.api_keys, gateway.metrics_token; as root:
    the files are root's and the verb is too); what was done, one line each.
    KeysError when a file cannot be used or the gateway refuses; the gateway
    then keeps that file's keys."""
    from hostd import config, paths
    from hostd.gateway import control

    try:
        cfg = config.load_model(name, config.config_root(root)).config
    except config.ConfigError as exc:
        raise KeysError(f"cannot find model {name}'s keys file: its config does not load: {exc}") from None
    done = []
    for of in KEYS_FILES:
        configured = of.configured(cfg.gateway)
        if not configured:
            continue
        fresh = read(Path(configured), of)
        try:
            answer = control.call(paths.control_socket(name), control.Keys(source=configured, keys=fresh))
        except control.ControlError as exc:
            raise KeysError(f"the gateway of model {name} kept its gateway.{of.key} keys: {exc}") from None
        done.append(f"model {name}: the gateway serves with {answer.keys} key(s) from {configured}")
    return "\n".join(done) or f"model {name} has no gateway.api_keys or gateway.metrics_token: no keys to replace"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hostd.gateway.keys",
        description="give model NAME's running gateway the keys in its keys file (systemctl reload model@NAME runs it)")
    parser.add_argument("name", metavar="NAME")
    parser.add_argument("--config-dir", metavar="DIR", help="configuration root (default: $HOSTD_CONFIG_DIR or /etc/hostd)")
    args = parser.parse_args(argv)
    try:
        print(push(args.name, Path(args.config_dir) if args.config_dir else None))
    except KeysError as exc:
        print(f"hostd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
