"""Where each model's sockets and state live on a host.

One job: name the paths. Every process derives them from here, so the unit
templates, the daemons and the config validator agree. The runtime directory
/run/hostd/NAME is private (0700, owned by the service user); the longest socket
path under it decides how long a model name may be (sun_path holds 107 bytes
plus its terminating NUL).
"""

from __future__ import annotations

import os
from pathlib import Path

RUNTIME_ROOT = Path("/run/hostd")
STATE_ROOT = Path("/var/lib/hostd")
CACHE_ROOT = Path("/var/cache/hostd")  # CacheDirectory=hostd/%i of every model unit
CONFIG_ROOT = Path("/etc/hostd")

# Entries of STATE_ROOT (and names under RUNTIME_ROOT) that are not a model's:
# a model of that name would get them as its state directory, chowned to it.
RESERVED_NAMES = {
    "checkpoints": "docs/quickstart.md keeps every model's checkpoint in /var/lib/hostd/checkpoints",
    "installed-files": "hostd install lists the files it wrote in /var/lib/hostd/installed-files",
}

SUN_PATH_MAX = 107  # bytes, without the terminating NUL

# Socket files inside /run/hostd/NAME. vLLM names its sockets itself, after the
# GPU's UUID ("GPU-" + 36 characters), inside the socket directory we give it.
WEIGHTS_SOCKET = "weights.sock"
# The weight daemons of a model: "main" at all times; "next" only during a
# checkpoint swap, loading the new checkpoint beside main (units.WEIGHTS_NEXT).
WEIGHTS_SOCKETS = {"main": WEIGHTS_SOCKET, "next": "weights-next.sock"}
ENGINE_SOCKET = "engine.sock"
# The engine slots of a model (units.py names their units): "main" serves at
# rest; "next" runs only during an overlap reload, beside main; "standby" runs
# beside main at all times for a model with `standby: true`.
ENGINE_SOCKETS = {"main": ENGINE_SOCKET, "next": "engine-next.sock", "standby": "engine-standby.sock"}
CONTROL_SOCKET = "control.sock"
# Where model-engine-spare@NAME (`spare: true`) takes fork requests from the
# main engine's start (hostd/engine/spare.py): the model's user only (0600).
SPARE_SOCKET = "engine-spare.sock"
# Where each slot's `vllm serve --uds` listens, behind hostd's engine socket of
# that slot: two engines of one model (an overlap reload, a standby) never share
# one ("standby": model-engine-standby@NAME's vLLM, `standby: true`).
VLLM_ENGINE_SOCKETS = {"main": "vllm-engine.sock", "next": "vllm-engine-next.sock",
                       "standby": "vllm-engine-standby.sock"}
VLLM_SOCKET_DIR = "vllm"
SGLANG_SOCKET_DIR = "sglang"
# The upstream daemon of the next weight slot (a checkpoint swap's,
# model-weights-next@NAME) keeps its sockets, lock and .ready files apart:
# each daemon empties its directory when it starts and stops, and vLLM's
# per-GPU lock refuses a second daemon in one directory. Four characters, as
# vLLM's own directory: the longest socket path, and so the longest model
# name, stay as they were.
NEXT_SOCKET_DIR = "next"
_LONGEST_UPSTREAM_SOCKET = (
    "vllm/vllm_weight_cache_GPU-00000000-0000-0000-0000-000000000000.sock"
)


def runtime_root() -> Path:
    """The runtime root; HOSTD_RUNTIME_DIR moves it for runs by hand and tests."""
    return Path(os.environ.get("HOSTD_RUNTIME_DIR") or RUNTIME_ROOT)


def runtime_dir(name: str) -> Path:
    return runtime_root() / name


def weights_socket(name: str, slot: str = "main") -> Path:
    return runtime_dir(name) / WEIGHTS_SOCKETS[slot]


def engine_socket(name: str, slot: str = "main") -> Path:
    return runtime_dir(name) / ENGINE_SOCKETS[slot]


def spare_socket(name: str) -> Path:
    return runtime_dir(name) / SPARE_SOCKET


def upstream_socket_dir(name: str, main_dir: str, slot: str = "main") -> Path:
    """The directory of the upstream weight daemon of weight slot SLOT
    (MAIN_DIR for main: VLLM_SOCKET_DIR or SGLANG_SOCKET_DIR)."""
    return runtime_dir(name) / (main_dir if slot == "main" else NEXT_SOCKET_DIR)


def vllm_engine_socket(name: str, slot: str = "main") -> Path:
    """Where `vllm serve --uds` of SLOT listens (hostd/engine/upstream.py proxies it)."""
    return runtime_dir(name) / VLLM_ENGINE_SOCKETS[slot]


def control_socket(name: str) -> Path:
    return runtime_dir(name) / CONTROL_SOCKET


def max_model_name_length() -> int:
    """The longest model name whose every socket path fits in sun_path."""
    fixed = len(f"{RUNTIME_ROOT}/") + len("/") + len(_LONGEST_UPSTREAM_SOCKET)
    return SUN_PATH_MAX - fixed


def manager_state_root() -> Path:
    """The manager's records: root's own directory, apart from the service
    user's state_dir, so the service user cannot forge what root acts on.
    ('.manager' cannot be a model name.) What lies inside is
    hostd/manager/records.py's alone."""
    return Path(os.environ.get("HOSTD_STATE_DIR") or STATE_ROOT) / ".manager"


def state_dir(name: str) -> Path:
    """Per-model state; HOSTD_STATE_DIR moves the root for runs by hand and tests."""
    return Path(os.environ.get("HOSTD_STATE_DIR") or STATE_ROOT) / name


def cache_dir(name: str) -> Path:
    """Per-model caches (compile caches, HF_HOME); HOSTD_CACHE_DIR moves the root for tests."""
    return Path(os.environ.get("HOSTD_CACHE_DIR") or CACHE_ROOT) / name
