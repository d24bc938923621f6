"""An engine's GET /health answer: the one type every producer builds and every reader decodes.

One job: the contract between an engine process and the manager and the
gateway. The builtin engine (engine/app.py, with the start-up facts of
engine/main.py) and the vLLM/SGLang supervisor (engine/upstream.py) encode an
EngineHealth; the manager (manager/probe.py and the reload rooms after it)
and the gateway (its /metrics' ModelFacts) decode one with ``parse``.

Trust: the manager runs as root and the gateway as the model's user; the
engine runs the model's code. So a reader takes at most MAX_BYTES, decodes
against this fixed schema (wrong types: not an answer), and ignores fields it
does not know, so that an older or newer engine still answers; a field an
engine does not send stays UNSET, and is left out when encoded, so the JSON
on the wire has exactly the keys its producer set (the Cockpit page, hostctl
and the tests read them). Torch-free: the manager and the gateway import it.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import UNSET, UnsetType

# Raised when a field changes meaning, so a reader can tell an engine of
# another hostd (absent: 1, the /health before it was a type).
HEALTH_VERSION = 1
MAX_BYTES = 1 << 20  # an answer is a few KiB in practice; a reader takes no more


class EngineHealth(msgspec.Struct, kw_only=True):
    """GET /health of one engine. Contract fields first (what the manager
    and the gateway read), then the engine's own facts beside them."""

    health_version: int = HEALTH_VERSION
    status: Union[str, UnsetType] = UNSET  # "ok"; "shutting_down" (builtin, 503); "unhealthy" (upstream, 503)

    # --- the contract: read by the manager and the gateway
    engine_config: Union[dict[str, Any], UnsetType] = UNSET  # the engine section it runs: verify, rollback
    weights: Union[Literal["daemon", "disk"], UnsetType] = UNSET  # hostd_weights_retained
    weights_not_retained: Union[str, UnsetType] = UNSET  # upstream: why the weights are its own ("" retained)
    weights_pid: Union[int, None, UnsetType] = UNSET  # the weight daemon it attached: verify's same-daemon rule
    weights_socket_inode: Union[int, None, UnsetType] = UNSET
    slot: Union[str, UnsetType] = UNSET  # main, next, standby
    upstream_version: Union[str, UnsetType] = UNSET  # hostd_build_info's ("" builtin)
    memory: Union[dict[str, int], UnsetType] = UNSET  # hostd/memory.py snapshot(): the CPU overlap preflight
    bridge: Union[str, UnsetType] = UNSET  # upstream: what the next slot's bridge runs with ("" otherwise)
    kv_cache_bytes: Union[int, None, UnsetType] = UNSET  # the KV cache it holds: a second engine's need
    max_body_bytes: Union[int, UnsetType] = UNSET  # the largest request body it reads: the gateway's cap follows

    # --- the builtin engine's own facts (engine/app.py, engine/main.py)
    model: Union[str, UnsetType] = UNSET  # its served name
    pid: Union[int, UnsetType] = UNSET
    max_num_seqs: Union[int, UnsetType] = UNSET
    max_model_len: Union[int, UnsetType] = UNSET
    batching: Union[str, UnsetType] = UNSET
    running: Union[int, UnsetType] = UNSET
    waiting: Union[int, UnsetType] = UNSET
    running_max: Union[int, UnsetType] = UNSET
    tokens_per_s: Union[float, UnsetType] = UNSET
    kv_blocks_used: Union[int, UnsetType] = UNSET
    kv_blocks_total: Union[int, UnsetType] = UNSET
    kv_block_tokens: Union[int, UnsetType] = UNSET
    content_digest: Union[str, UnsetType] = UNSET  # the attached weights' fingerprint digest
    checkpoint: Union[str, UnsetType] = UNSET  # the checkpoint directory it serves (resolved)
    shared_ptr: Union[int, UnsetType] = UNSET  # the daemon's allocation, and how many tensors lie outside it
    shared_bytes: Union[int, UnsetType] = UNSET
    tensors_total: Union[int, UnsetType] = UNSET
    tensors_outside_shared: Union[int, UnsetType] = UNSET
    phases_s: Union[dict[str, float], UnsetType] = UNSET  # seconds per start-up phase
    rebuild_s: Union[dict[str, float], None, UnsetType] = UNSET  # the last rebuild (in place, or the standby's), per phase
    rebuilds: Union[bool, UnsetType] = UNSET  # answers POST /hostd/rebuild (builtin main and standby): in place
    # the standby slot's KV cache (engine/standby_kv.py): "idle" (reload.standby_kv_mib) or "full",
    # the full budget it grows to, and the last grow's seconds per phase
    kv_budget: Union[Literal["idle", "full"], UnsetType] = UNSET
    kv_cache_bytes_full: Union[int, UnsetType] = UNSET
    grow_s: Union[dict[str, float], None, UnsetType] = UNSET

    # --- the vLLM/SGLang supervisor's own facts (engine/upstream.py)
    backend: Union[str, UnsetType] = UNSET
    upstream_health: Union[int, None, UnsetType] = UNSET  # upstream's own /health status code
    upstream_pid: Union[int, None, UnsetType] = UNSET



def sent(value: Any) -> Any:
    """A field's VALUE as the engine sent it, None when it did not send it
    (UNSET): read `sent(health.engine_config)`, never by name."""
    return None if value is UNSET else value


def facts(**fields: Any) -> dict[str, Any]:
    """FIELDS, a producer's facts for its /health (engine/main.py's
    health_info), checked against EngineHealth's names now: a misspelt one
    fails the engine's start, not each /health later (TypeError)."""
    EngineHealth(**fields)
    return fields


def encode(health: EngineHealth) -> bytes:
    return msgspec.json.encode(health)


def parse(body: bytes) -> Optional[EngineHealth]:
    """BODY (at most MAX_BYTES of an engine's /health) as an EngineHealth; None
    when it is longer, not JSON, or not this schema."""
    if len(body) > MAX_BYTES:
        return None
    try:
        return msgspec.json.decode(body, type=EngineHealth)
    except msgspec.DecodeError:  # ValidationError is one
        return None
