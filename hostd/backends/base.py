"""The backend interface: everything hostd needs to know to run one model.

One job: be the only place outside the configuration schema that knows which
backends exist. Callers get a Backend from for_config() (hostd/backends/__init__.py,
the one switch on the backend's name) and ask it; nobody else compares the
name. A backend answers, for a model's config: what `hostd weights NAME` and
`hostd engine NAME` run, what it refuses before anything is torn down, whether
its units need the GPU devices, which fraction of a GPU its engine sizes its
memory by, and how long it lets admitted requests finish when asked to stop
(its drain).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional


class BackendRefused(Exception):
    """The config asks for something this backend cannot do; nothing was touched."""


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # Variables the child must not see at all, whoever set them (hostd's own
    # environment or the model's env:); an empty value is not the same to it.
    unset: tuple[str, ...] = ()


class Backend(abc.ABC):
    name: ClassVar[str]
    # The engine's routes the gateway passes to the public port, (method,
    # path template with {name} for one segment); every other path is 404
    # there (docs/gateway.md lists them). Internal ones are never listed.
    public_routes: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Families of the engine's /metrics that the gateway's /metrics passes on.
    metrics_prefixes: ClassVar[tuple[str, ...]] = ()
    # The public routes whose answers carry generated tokens (OpenAI's
    # completions and chat completions: a 200 body, or SSE chunks of
    # choices[].text / choices[].delta): the gateway's time to first token
    # is measured on these only.
    token_routes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    )
    # The package whose code runs the model, hostd_build_info's upstream label.
    upstream_package: ClassVar[str] = ""
    # Does the engine rebuild itself on a reload's new engine section in its
    # own process (builtin: POST /hostd/rebuild), the main engine under the
    # in-place strategy and the warm standby (`standby: true`) under its own?
    # Upstream servers cannot: a limit change restarts them, and their
    # standby serves the config it started with (strategies.UpstreamStandby).
    rebuilds_in_place: ClassVar[bool] = False

    def engine_socket(self, model: str, slot: str = "main") -> Optional[Path]:
        """The Unix socket upstream's server of SLOT listens on (vLLM's
        --uds), to which the gateway sends that slot's public requests: one
        proxy less on every token; hostd's engine supervisor keeps /health and
        /metrics. None: hostd's engine socket serves them (the builtin engine;
        SGLang, on the private loopback port passed to its engine_command())."""
        return None

    # ------------------------------------------------------------ entry points

    # hostd/dispatch.py calls these once it has checked CFG; a daemon that
    # needs its backend gets this one as a parameter and never looks it up.

    @abc.abstractmethod
    def run_weights(self, args, cfg) -> int:
        """`hostd weights NAME` for this backend (model-weights@NAME.service):
        hold the weights until SIGTERM; returns the exit code."""

    @abc.abstractmethod
    def run_engine(self, args, cfg) -> int:
        """`hostd engine NAME` for this backend (model-engine@NAME.service):
        serve HTTP on engine.sock until SIGTERM; returns the exit code."""

    # ------------------------------------------------------------ refusals

    @abc.abstractmethod
    def refusals(self, cfg) -> list[str]:
        """Every reason CFG cannot be served, each naming the setting; empty
        when fine. From the config and the checkpoint's files alone: it never
        runs or imports upstream code, because the root manager calls it."""

    def install_refusals(self, cfg) -> list[str]:
        """What the upstream installation the model runs says about itself
        (missing, broken, too old). This runs upstream's code, so only the
        model's own units call it (check(), as the model's user); never root."""
        return []

    def engine_refusals(self, cfg, model_config: dict) -> list[str]:
        """What the engine refuses at start, given the model's config.json."""
        return []

    def start_refusals(self, cfg) -> list[str]:
        """What the engine would refuse at start that the config and the
        checkpoint's config.json alone tell (no device, no upstream code):
        `hostctl config --check`, `hostctl reload --check` and the manager's
        Reload validation refuse it before anything is torn down, with the
        words the engine would use. Empty when config.json cannot be read
        (refusals() or the engine say so)."""
        return []

    def check(self, cfg, model_config: Optional[dict] = None) -> None:
        """Raise BackendRefused naming every problem; with MODEL_CONFIG (the model's
        config.json) also what the engine refuses at start."""
        problems = self.refusals(cfg) + self.install_refusals(cfg)
        if model_config is not None:
            problems += self.engine_refusals(cfg, model_config)
        if problems:
            raise BackendRefused("; ".join(problems))

    # ------------------------------------------------------------ facts

    @abc.abstractmethod
    def uses_gpu(self, cfg) -> bool:
        """Do the model's units need the NVIDIA devices (DeviceAllow=, the
        manager's GPU memory preflight)?"""

    def overlap_refusal(self, cfg) -> Optional[str]:
        """Why two engines of this model cannot run at once on the same weights
        (an overlap reload then falls back to restart), or None when they can.
        Each slot has its own sockets (hostd/paths.py), so by default they can."""
        return None

    def bridge_need(self, cfg) -> Optional[int]:
        """Bytes the overlap reload's second engine needs beyond the weights it
        shares, per GPU (of host memory on CPU), when this backend sizes that
        engine itself (a bridge with its own KV budget: vllm, sglang); None
        when it needs what the serving engine uses (builtin), which the
        preflight then measures."""
        return None

    def upstream_version(self, cfg) -> str:
        """The version of upstream_package that CFG's engine runs, '' when it
        cannot be told. Only the engine calls it (the upstream backends run
        upstream's executable for it, as install_refusals does)."""
        return ""

    def weights_not_retained(self, cfg) -> Optional[str]:
        """Why CFG's weights are not kept across engine restarts (the engine
        loads them from disk each start), or None when they are."""
        return None

    def engine_kv_bytes(self, cfg, device_total: Optional[int], swap: bool = False) -> Optional[int]:
        """Bytes of KV cache CFG's engine allocates at start beyond the shared
        weights (per GPU, of host memory on CPU), when the engine sizes it
        from CFG (builtin's paged cache); DEVICE_TOTAL is the device's
        memory; SWAP: the engine of a checkpoint swap (the next weight slot).
        None when the engine does not, or it cannot be told here."""
        return None

    #: The engine key memory_fraction reads (the check across models names it).
    memory_fraction_key: Optional[str] = None

    def memory_fraction(self, cfg) -> Optional[float]:
        """The fraction of each GPU the engine sizes its memory pool by, which
        includes the daemon-held weights; None when it sizes by need."""
        return None

    @abc.abstractmethod
    def drain_seconds(self, cfg) -> float:
        """How long the engine lets admitted requests finish after SIGTERM."""


def checkpoint_bytes(model_dir: str) -> int:
    """The bytes of the *.safetensors files of the checkpoint directory
    MODEL_DIR: what a weight daemon or an engine loading them from disk holds
    (unquantized, at the dtype they are stored in); a file that cannot be
    read counts 0 (the load then says why)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass
    return total
