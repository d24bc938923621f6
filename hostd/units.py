"""The names of each model's systemd units.

One job: name the units, as hostd/paths.py names the sockets. The unit
templates in units/ are the other side of these names; everything in hostd/
that talks to systemd, writes a generator drop-in or tells an administrator
what to type takes the name from here.
"""

from __future__ import annotations

UMBRELLA = "model@.service"  # the gateway, and the unit an administrator starts
SOCKET = "model@.socket"
ENGINE = "model-engine@.service"
# The second engine slot: started only by an overlap reload, beside ENGINE, and
# stopped once ENGINE serves the new config again (docs/operations.md).
ENGINE_NEXT = "model-engine-next@.service"
ENGINES = {"main": ENGINE, "next": ENGINE_NEXT}
WEIGHTS = "model-weights@.service"
WEIGHTS_SOCKET = "model-weights@.socket"
MANAGER = "hostd.service"


def instance(template: str, name: str) -> str:
    """TEMPLATE ("model@.service") instantiated for model NAME."""
    prefix, _, suffix = template.partition("@")
    return f"{prefix}@{name}{suffix}"


def umbrella(name: str) -> str:
    return instance(UMBRELLA, name)


def socket(name: str) -> str:
    return instance(SOCKET, name)


def engine(name: str, slot: str = "main") -> str:
    return instance(ENGINES[slot], name)


def weights(name: str) -> str:
    return instance(WEIGHTS, name)
