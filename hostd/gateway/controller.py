"""What the control socket's requests do to one gateway (control.py carries
them): drain and resume around a restart reload, switch new requests to
another engine's slot and back, settle a slot, replace the API keys, mark
an in-place reload's begin and end, answer the status; and the reload
clock those requests start and stop (metrics.ReloadClock:
hostd_gateway_reload_*).

Trusts every request it is handed: only root and the manager can reach the
control socket (0600 in the model's 0700 runtime directory, control.py);
what it refuses is what the gateway cannot do (another keys file, keys on a
gateway started without them, a switch slots.py refuses), as a ControlError
the manager reports.
"""

from __future__ import annotations

import asyncio
import logging

from hostd.gateway import control, keys
from hostd.gateway.metrics import ReloadClock
from hostd.gateway.slots import SwitchRefused
from hostd.gateway.state import HELD, State

log = logging.getLogger("hostd.gateway")


class Controller:
    """The control socket's handler for GATEWAY (a server.Gateway: its
    admission, slots, metrics, keys and engine_ok; handed in, not imported)."""

    def __init__(self, gateway):
        self.gateway = gateway
        self.reload_clock = ReloadClock(gateway.metrics)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def state_changed(self, old: State, new: State) -> None:
        """Admission's on_change: a reload's time without serving ends when it serves again."""
        self.reload_clock.serving(self._now(), new == State.SERVING)

    async def __call__(self, request: control.Request) -> control.Answer:
        gateway = self.gateway
        admission, slots = gateway.admission, gateway.slots
        if isinstance(request, control.Drain):
            gateway.metrics.drains.inc()
            # A drain answers 503 from now on; one while already drained is the same reload's.
            self.reload_clock.begin(self._now(), serving=False, retry=admission.state in HELD)
            log.info("drain requested (timeout %.1f s), %d in flight", request.timeout, admission.in_flight)
            result = await admission.drain(request.timeout)
            log.info("drain %s", "complete" if result.drained else f"timed out, {result.remaining} still running")
        elif isinstance(request, control.Resume):
            result = await admission.resume(await gateway.engine_ok())
            self.reload_clock.end(self._now(), request.outcome or result.state)
            log.info("resumed: %s", result.state)
        elif isinstance(request, control.Switch):
            if request.outcome is not None and request.slot != "main":
                raise control.ControlError("outcome ends a reload: it goes with the switch back to main")
            moved = request.slot != slots.current
            result = await self.switch(request.slot)
            # An overlap reload runs from the switch to the second engine to the switch back.
            if moved and request.slot != "main":
                self.reload_clock.begin(self._now(), serving=admission.state == State.SERVING)
            elif moved or request.outcome:
                self.reload_clock.end(self._now(), request.outcome or result.state)
        elif isinstance(request, control.Keys):
            result = self.replace_keys(request)
        elif isinstance(request, control.Mark):
            # An in-place reload: the engine rebuilds behind the same socket; only the clock moves.
            if request.outcome is None:
                self.reload_clock.begin(self._now(), serving=admission.state == State.SERVING)
            else:
                self.reload_clock.end(self._now(), request.outcome)
            result = admission.snapshot(slots.current, slots.failed_over)
        elif isinstance(request, control.Settle):
            log.info("settle: waiting for %d request(s) on the %s engine", admission.on_slot.get(request.slot, 0),
                     request.slot)
            result = await admission.settle(request.slot, request.timeout)
        else:
            result = admission.snapshot(slots.current, slots.failed_over)
        gateway.report()
        return result

    def replace_keys(self, request: control.Keys) -> control.KeysReplaced:
        """Check the next requests against REQUEST's keys (root sent them:
        control.py) where its source is the keys file the gateway started
        with: gateway.api_keys for the public port, gateway.metrics_token for
        the metrics listener; admitted ones are not touched. Keys on or off,
        or another file, change the unit (LoadCredential=): a restart."""
        gateway = self.gateway
        restart = f"systemctl restart model@{gateway.name}"
        # Each keys file's keys are the Gateway's attribute of its key's name (api_keys, metrics_token).
        replaced = [of for of in keys.KEYS_FILES if getattr(gateway, of.key) is not None
                    and of.configured(gateway.cfg.gateway) == request.source]
        if not replaced:
            started = [f"{of.configured(gateway.cfg.gateway)} (gateway.{of.key})" for of in keys.KEYS_FILES
                       if getattr(gateway, of.key) is not None]
            raise control.ControlError(
                f"this gateway was started with the keys files {', '.join(started)}, not {request.source}; "
                f"another keys file, or keys on, take `{restart}`" if started else
                f"this gateway was started without gateway.api_keys or gateway.metrics_token; keys on take `{restart}`")
        for of in replaced:
            before = len(getattr(gateway, of.key))
            setattr(gateway, of.key, keys.encoded(request.keys))
            log.info("%s replaced from %s: %d key(s), %d before; admitted requests run on", of.what,
                     request.source, len(request.keys), before)
        return control.KeysReplaced(keys=len(request.keys))

    async def switch(self, slot: str) -> control.GatewayStatus:
        """New requests go to SLOT's engine from now on (slots.py)."""
        gateway = self.gateway
        try:
            await gateway.slots.switch(slot, gateway.admission.in_flight)
        except SwitchRefused as exc:
            raise control.ControlError(str(exc)) from None
        return gateway.admission.snapshot(gateway.slots.current)
