"""The backend interface: everything hostd needs to know to run one model.

A backend answers, for a model's config: the weight daemon's and the engine's
command and environment, which fields a reload may change, how to tell that
the engine serves, what it refuses before anything is torn down, and how long
it lets admitted requests finish when asked to stop (its drain).
"""

from __future__ import annotations

import abc
import sys
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from hostd.config import schema


class Refused(Exception):
    """The config asks for something this backend cannot do; nothing was touched."""


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class Backend(abc.ABC):
    name: ClassVar[str]
    # The engine's routes the gateway passes to the public port, (method,
    # path template with {name} for one segment); every other path is 404
    # there (docs/gateway.md lists them). Internal ones are never listed.
    public_routes: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Families of the engine's /metrics that the gateway's /metrics passes on.
    metrics_prefixes: ClassVar[tuple[str, ...]] = ()

    def editable_fields(self) -> tuple[str, ...]:
        return schema.editable_fields(self.name)

    @abc.abstractmethod
    def weights_command(self, model: str, cfg) -> Command:
        """What model-weights@MODEL.service runs."""

    @abc.abstractmethod
    def engine_command(self, model: str, cfg) -> Command:
        """What model-engine@MODEL.service runs; it serves HTTP on engine.sock."""

    @abc.abstractmethod
    def refusals(self, cfg) -> list[str]:
        """Every reason CFG cannot be served, each naming the setting; empty when fine."""

    def engine_refusals(self, cfg, model_config: dict) -> list[str]:
        """What the engine refuses at start, given the model's config.json."""
        return []

    def check(self, cfg, model_config: Optional[dict] = None) -> None:
        """Raise Refused naming every problem; with MODEL_CONFIG (the model's
        config.json) also what the engine refuses at start."""
        problems = self.refusals(cfg)
        if model_config is not None:
            problems += self.engine_refusals(cfg, model_config)
        if problems:
            raise Refused("; ".join(problems))

    @abc.abstractmethod
    def drain_seconds(self, cfg) -> float:
        """How long the engine lets admitted requests finish after SIGTERM."""

    @staticmethod
    def hostd_argv(*args: str) -> list[str]:
        return [sys.executable, "-m", "hostd.main", *args]
