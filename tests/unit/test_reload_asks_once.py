"""How many times one reload asks the engines for /health and the weight
daemon for its status (issue 49 Build 4, acceptance 3: ask once), for an
overlap reload and a standby reload (builtin backend: the standby rebuilds).

reload_fakes.FakeProbe fakes verify_engine and weights_identity wholesale;
here they are the real Probe's (hostd/manager/probe.py) on the fake's
primitives, so the counts are what the real probe would ask. The weight
daemon answers a real weights/protocol Status for the checkpoint on disk (no
swap). Each ask is recorded with its slot and where it comes from."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reload_fakes  # noqa: E402

from hostd.manager import reload as R  # noqa: E402
from hostd.manager.probe import Probe  # noqa: E402

# The asks of one done first reload, by kind and slot (issue 49 Build 4).
# Before the ask-once (4bf6be2..9613bb1): overlap 4 /health (main in
# validate and verify; next in its verify and again for the bridge note)
# and 4 weight-daemon statuses (swap_of, record, each verify); standby 4 and
# 4 likewise (standby_problem, and the standby's verify after its rebuild).
# Now: the daemon once in validate (records.running, change_of and record
# read that answer) and once in the main engine's verify; a verify returns
# the /health it checked; a rebuild's answer is the engine's /health.
ASKS = {
    "overlap": {("health", "main"): 2, ("health", "next"): 1, ("weights_status", "main"): 2},
    "standby": {("health", "main"): 2, ("health", "standby"): 1, ("weights_status", "main"): 2},
    "in-place": {("health", "main"): 1, ("weights_status", "main"): 2},
}

HOSTD = str(Path(R.__file__).resolve().parents[1])  # .../hostd


def caller() -> str:
    """Where the ask comes from: the first three frames in hostd/ above it
    (probe.py's own, when the real verify_engine asks, then reload.py's)."""
    where, frame = [], sys._getframe(2)
    while frame is not None and len(where) < 3:
        path = frame.f_code.co_filename
        if path.startswith(HOSTD):
            where.append(f"{Path(path).relative_to(Path(HOSTD).parent)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(where) or "?"


class AskingProbe(reload_fakes.FakeProbe):
    """FakeProbe with the real verify_engine and weights_identity, counting asks."""

    verify_engine = Probe.verify_engine
    weights_identity = Probe.weights_identity

    def __init__(self, world):
        super().__init__(world)
        self.name = world.name
        self.asks: list[tuple[str, str, str]] = []  # (kind, slot, caller)

    async def engine_health(self, slot: str = "main"):
        self.asks.append(("health", slot, caller()))
        return await super().engine_health(slot)

    async def weights_status(self, slot: str = "main"):
        self.asks.append(("weights_status", slot, caller()))
        return await super().weights_status(slot)


def breakdown(asks) -> str:
    return "\n".join(f"  {i}. {kind:14} slot {slot:7} from {where}" for i, (kind, slot, where) in enumerate(asks, 1))


@pytest.mark.parametrize("strategy", ["overlap", "standby", "in-place"])
def test_a_reload_asks_health_and_weights_status_at_most_twice_per_process(tmp_path, monkeypatch, strategy):
    monkeypatch.setattr(reload_fakes, "FakeProbe", AskingProbe)
    world = reload_fakes.World(tmp_path, strategy="overlap" if strategy == "standby" else strategy,
                               standby=strategy == "standby")
    op = asyncio.run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name, op.error) == (R.State.DONE, strategy, "")
    assert op.weights_reused
    asks = world.probe.asks
    counts: dict = {}
    for kind, slot, _ in asks:
        counts[kind, slot] = counts.get((kind, slot), 0) + 1
    assert counts == ASKS[strategy], f"{strategy} reload asked:\n{breakdown(asks)}"
    assert max(counts.values()) <= 2
