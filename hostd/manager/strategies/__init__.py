"""The reload strategies: one object per strategy, each holding what that
strategy is: its stages (the path of a reload that ends done, which the
Operation publishes as Stages), the stages Cancel() may end (Cancellable),
what a stage that is cancelled, interrupted or fails leaves (its restore),
and what recovery (recovery.py) does with the intent a crashed manager left
under it. reload.py keeps the skeleton every strategy shares (validate,
preflight, record, the main engine's restart and verify, commit, rollback)
and the one driver that runs it (Reload._apply), calling the chosen
strategy's hooks (base.py); choose() is the preflight's choice among them.
One second-engine strategy (SecondEngine) holds the steps overlap and
standby share.

One file per strategy, its own diagram and stage notes at its top:
restart.py (Restart), overlap.py (Overlap), standby.py (Standby), swap.py
(Swap, an overlap on the weights too); second_engine.py (SecondEngine) holds
the steps overlap and standby share, base.py (Strategy) what every strategy
is and the helpers several call. This file holds the registry (STRATEGIES,
named) and the preflight's choice (choose, choose_swap): the variant is
chosen once, in one switch, and a strategy never looks another up.

A strategy is handed the reload it runs (a reload.Reload) or the model it
recovers (a reload.ModelHandles); this package names them under
TYPE_CHECKING only, so no import circle opens at run time.
Adding a strategy: a file here with its class (a Strategy, or a
SecondEngine when a second engine serves meanwhile), its instance and entry
in STRATEGIES below, and its place in choose().

Trust: nothing here is read from outside the manager: the engines, the
gateway and systemd are reached through the probe and the systemd client the
handles carry, which apply their own caps.

Five strategies, chosen by the preflight (Operation.strategy says which, and
why in the journal): `in-place` (reload.strategy: in-place; the builtin
engine rebuilds on new limits in its own process, when nothing else changes
and the new KV cache fits beside the old one, in_place_refusal; otherwise as
under overlap), `swap` (a checkpoint swap: the target's checkpoint is not
the one the main weight daemon holds), `standby` (a model with
`standby: true` whose standby answers and the gateway serves from main),
`overlap` (otherwise) and `restart` (forced by reload.strategy:
restart, and the fallback when the backend cannot run two engines or there is
no room for a second one; never for a swap that does not fit, which is
refused unless reload.strategy is restart).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from hostd import backends
from hostd.manager import errors
from hostd.manager.strategies.base import Run, Strategy, restart_main, until_asked
from hostd.manager.strategies.in_place import InPlace, in_place_refusal
from hostd.manager.strategies.overlap import Overlap
from hostd.manager.strategies.restart import Restart
from hostd.manager.strategies.second_engine import SecondEngine
from hostd.manager.strategies.standby import Standby, UpstreamStandby, put_standby_on, restart_in_background
from hostd.manager.strategies.swap import Swap, checkpoint_bytes, swap_problem

if TYPE_CHECKING:
    from hostd.manager.preflight import Memory

__all__ = [
    "IN_PLACE", "InPlace", "OVERLAP", "RESTART", "STANDBY", "STRATEGIES", "SWAP", "UPSTREAM_STANDBY", "Overlap", "Restart", "SecondEngine",
    "Standby", "Strategy", "Swap", "UpstreamStandby", "checkpoint_bytes", "choose", "choose_swap", "named", "put_standby_on",
    "restart_in_background", "restart_main", "standby_for", "standby_problem", "swap_problem", "until_asked",
]

log = logging.getLogger("hostd.manager.reload")

RESTART, OVERLAP, STANDBY, SWAP, IN_PLACE = Restart(), Overlap(), Standby(), Swap(), InPlace()
UPSTREAM_STANDBY = UpstreamStandby()  # also named standby: standby_for picks it for vllm, sglang
STRATEGIES = {strategy.name: strategy for strategy in (RESTART, OVERLAP, STANDBY, SWAP, IN_PLACE)}


def standby_for(cfg) -> Standby:
    """The standby variant of CFG's backend, the one switch: the builtin
    standby rebuilds in its own process (Standby); vLLM's and SGLang's
    serve the config they started with (UpstreamStandby)."""
    return STANDBY if backends.for_config(cfg).rebuilds_in_place else UPSTREAM_STANDBY


def named(name: str, cfg=None) -> Strategy:
    """The strategy NAME (an Intent's record on disk), the standby's variant
    for CFG (the model's config) when given; records of an older manager had
    none and were all restarts, and so is a name this manager does not know
    (recovery then drains before it restarts anything)."""
    strategy = STRATEGIES.get(name, RESTART)
    return standby_for(cfg) if strategy is STANDBY and cfg is not None else strategy


async def choose(run: Run, memory: Memory) -> tuple[Strategy, str]:
    """The preflight's choice for RUN (a reload.Reload after validate;
    MEMORY: the preflight's one reading) and why: standby when the model's
    warm standby can take it (standby_problem), else overlap when configured,
    possible for the backend and there is room for a second engine beside the
    first, else restart. Its notes go to the Operation; a refusal for
    memory raises (errors.InsufficientMemory, by the caller)."""
    op, current = run.op, run.current
    if current.reload.strategy == IN_PLACE.name:
        refusal = in_place_refusal(run)
        if refusal is None:
            never = run.model.probe.in_place_problem(run.target, run.health, memory, alone=True)
            if never:  # no engine of this config fits: refused, whatever would run it
                raise errors.InsufficientMemory(never)
            refusal = IN_PLACE.memory_problem(run, memory)
        if refusal is None:
            return IN_PLACE, "every changed key is the engine's limits: it rebuilds in its own process"
        op.notes.append(f"no in-place reload: {refusal}")  # as under overlap; the Operation says why
        if not run.dry_run:
            log.info("reload %d of %s: no in-place reload (%s); as under overlap", op.id, op.model, refusal,
                     extra=op.fields())
    if run.change.swaps:
        return choose_swap(run, memory)
    standby = await standby_problem(run)
    if standby is None:
        variant = standby_for(current)
        return variant, ("the warm standby serves while the main engine restarts" if variant is UPSTREAM_STANDBY
                         else "the warm standby rebuilds on the new config")
    if standby:
        op.notes.append(f"no standby reload: {standby}")
        if not run.dry_run:
            log.info("reload %d of %s: no standby reload (%s); as without a standby", op.id, op.model,
                     standby, extra=op.fields())
    if current.reload.strategy == RESTART.name:
        return RESTART, "reload.strategy is restart"
    problem = run.model.probe.overlap_problem(run.target, run.health, memory)
    if problem:
        why = f"overlap does not fit, falling back to restart: {problem}"
        op.notes.append(f"strategy restart: {why}")  # a fallback: the Operation says why, as the journal does
        return RESTART, why
    return OVERLAP, "room for a second engine beside the serving one"


def choose_swap(run: Run, memory: Memory) -> tuple[Strategy, str]:
    """A checkpoint swap: under reload.strategy restart, the model's weights
    and engine restart on the new checkpoint (503 meanwhile); otherwise the
    swap strategy, when the new weights and a second engine fit, else a
    refusal with the numbers. Never a silent fallback to restart: an
    unplanned 503 window of a whole weights load is not what `overlap` asks."""
    if run.current.reload.strategy == RESTART.name:
        return RESTART, ("reload.strategy is restart: the checkpoint swap stops the engine and weights "
                         "and starts them on the new checkpoint (503 meanwhile)")
    problem = swap_problem(run, memory)
    if problem:
        raise errors.InsufficientMemory(f"{problem}; with reload.strategy: restart the swap runs with a "
                                        "503 window instead")
    return SWAP, "room for the new checkpoint's weights and a second engine beside the serving pair"


async def standby_problem(run: Run) -> Optional[str]:
    """Why the standby cannot take RUN's reload ("" when the model has
    none), or None when it can: standby: true, reload.strategy is not
    restart, the standby answers, and the gateway sends new requests to the
    main engine (not during a failover)."""
    current, probe = run.current, run.model.probe
    if not getattr(current, "standby", False) or current.reload.strategy == RESTART.name:
        return ""
    if await probe.engine_health("standby") is None:
        return f"the standby ({run.model.standby_unit}) does not answer"
    status = await probe.gateway_status()
    if status is None:
        return "the gateway does not answer"
    if status.slot != "main":
        return f"the gateway sends new requests to the {status.slot} engine (a failover), not the main one"
    return None
