"""What the vllm and sglang backends share: refusals, environment and caches.

One job: the policy tables and helpers both upstream backends use, and the
UpstreamBackend they derive from, so that vllm.py and sglang.py only say what
differs (flag names, allowlists, the commands themselves, how their processes
tell they serve). Nothing here starts a process except the version check,
which asks the interpreter of the configured upstream console script (or
the configured Python) for the package's metadata, or runs a script that is
not one with --version, and never anything else. The
version check is an install_refusals(): the model's own units run it as the
model's user when they start; the root manager never does (it calls
refusals() only, and learns a wrong install from the engine that fails to
start, which the reload rolls back).
"""

from __future__ import annotations

import abc
import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from packaging.version import InvalidVersion, Version

from hostd import kv_bytes, nvml
from hostd.backends.base import Backend, Command, checkpoint_bytes
from hostd.checkpoints import config_file

# Variables that make PyTorch's allocator hand out expandable segments. CUDA
# IPC cannot export memory from them: both upstream weight caches refuse to
# start (SGLang checks both names; vLLM's IPC export fails on such storage).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# Refused in extra_args and engine_extra_args whether or not the weight cache
# holds the weights: they break hostd's own reload, not the cache.
COMMON_REFUSED_FLAGS = {
    "--api-key": "the manager's checks carry no key, so every reload would roll back; set "
                 "gateway.api_keys (docs/gateway.md, API keys): the gateway checks keys before the engine",
}

# Flags hostd itself sets on the upstream command lines. Giving one again in
# extra_args would make the weights and the engine disagree with hostd's
# units (another socket, another port, another layout), so it is refused.
COMMON_OWNED_FLAGS = {
    "--tensor-parallel-size": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "--served-model-name": "served_model_name",
    "--host": "listen (the gateway owns the public address)",
    "--port": "listen (the gateway owns the public address)",
}


def found_version(text: str) -> Optional[Version]:
    """The version in a program's answer ('0.31.2', 'vllm 0.31.2+cu128',
    '0.5.21.post1', '0.33.0rc1'), by PEP 440 (packaging), so that a release
    candidate sorts before its release; None when there is none."""
    for word in text.split():
        if re.match(r"v?\d+\.\d+", word):
            try:
                return Version(word)
            except InvalidVersion:
                continue
    return None


def canonical_flag(arg: str, aliases: dict[str, str]) -> Optional[str]:
    """The long flag ARG spells, as upstream's parser reads it, or None when
    ARG is a value. vLLM takes '_' for '-' in long names ('--max_num_seqs'),
    '--flag=value', and short aliases ('-q', '-tp', also '-qfp8' and '-q=fp8')
    that ALIASES maps to their long flag."""
    if arg.startswith("--") and len(arg) > 2:
        name = "--" + arg[2:].split("=", 1)[0].replace("_", "-")
        return aliases.get(name, name)
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit() and arg[1] != ".":
        for alias in sorted(aliases, key=len, reverse=True):
            if arg.startswith(alias):
                return aliases[alias]
        return arg.split("=", 1)[0]
    return None


def has_flag(args: list[str], *flags: str, aliases: Optional[dict[str, str]] = None) -> Optional[str]:
    """The first of FLAGS (long names) present in ARGS in any spelling upstream
    accepts (see canonical_flag), or None. Both upstream parsers also take an
    unambiguous prefix of a long flag ('--max-num-seq' is --max-num-seqs), so
    a prefix of FLAG counts too."""
    present = {canonical_flag(arg, aliases or {}) for arg in args} - {None}
    for flag in flags:
        if flag in present:
            return flag
    for flag in flags:
        if any(len(p) > 3 and p.startswith("--") and flag.startswith(p) for p in present):
            return flag
    return None


def effective_env(cfg) -> dict[str, str]:
    """What an upstream child sees: hostd's own environment plus the model's env:."""
    return {**os.environ, **cfg.env}


def canonical_dir(value: Optional[str], default: str, cwd: Optional[str] = None) -> str:
    """VALUE as the real absolute directory a process will use.

    Empty or unset means DEFAULT; '~' and '~/x' are expanded; a relative path
    is taken from CWD (default: ours); symlinks in the part that exists are
    resolved and a not-yet-created suffix is kept as written, so a symlinked
    root with a missing suffix still becomes its real path."""
    raw = value if value else default
    path = os.path.expanduser(raw)
    if not os.path.isabs(path):
        path = os.path.join(cwd or os.getcwd(), path)
    # realpath (non-strict) resolves every component that exists and appends
    # the rest unchanged.
    return os.path.realpath(path)


def cache_defaults(cfg, names: dict[str, str]) -> dict[str, str]:
    """Persistent cache variables under $CACHE_DIRECTORY (the CacheDirectory=
    both units share), for each NAME -> subdirectory the model and hostd's own
    environment leave unset. Outside systemd: none (upstream's defaults)."""
    root = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if not root:
        return {}
    seen = effective_env(cfg)
    return {name: str(Path(root) / sub) for name, sub in names.items() if not seen.get(name)}


def gpu_env(cfg) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the model's gpus:, unless env: sets it or the
    model runs on the CPU."""
    if "CUDA_VISIBLE_DEVICES" in cfg.env or cfg.device == "cpu":
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in cfg.gpus)}


_QUANTIZATION_CACHE: dict[tuple, Optional[dict]] = {}
_QUANTIZATION_CACHE_MAX = 64


def checkpoint_quantization(model_dir: str) -> Optional[dict]:
    """The checkpoint's own quantization_config (config.json), if any.

    Any user may make the manager ask (the D-Bus properties WeightsRetained,
    WeightsNotRetainedReason), and the checkpoint may be anyone's directory:
    the file is read by the one guarded reader (checkpoints/config_file.py: a
    FIFO cannot hang the reader, nor a huge file fill its memory), and once
    per identity (device, inode, size, mtime) of the file."""
    path = Path(model_dir) / "config.json"
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _QUANTIZATION_CACHE:
        if len(_QUANTIZATION_CACHE) >= _QUANTIZATION_CACHE_MAX:
            _QUANTIZATION_CACHE.clear()
        _QUANTIZATION_CACHE[key] = _read_quantization(path)
    quant = _QUANTIZATION_CACHE[key]
    return dict(quant) if quant is not None else None


def _read_quantization(path: Path) -> Optional[dict]:
    try:
        config = config_file.read(path.parent)
    except ValueError:
        return None
    quant = config.get("quantization_config")
    return quant if isinstance(quant, dict) else None


def editable_args(engine, flags: dict[str, str]) -> list[str]:
    """The command-line flags for ENGINE's editable keys (FLAGS: key -> upstream
    flag): none for an unset or false key, the bare flag for true, the flag
    and each value for a list (vLLM's capture sizes), else the flag and value."""
    args: list[str] = []
    for key, flag in flags.items():
        value = getattr(engine, key)
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, list):
            args += [flag, *(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args


def common_refusals(cfg, *, owned_flags: dict[str, str], refused_flags: dict[str, str],
                    editable_flags: dict[str, str], aliases: dict[str, str], retained: bool) -> list[str]:
    """The refusals both upstream backends make, each naming the setting.
    Without the weight cache (not RETAINED) what only the cache cannot do is
    not refused: REFUSED_FLAGS are then only those hostd itself cannot run."""
    problems = []
    model = Path(cfg.model)
    if cfg.model.endswith(".gguf") or (model.is_dir() and list(model.glob("*.gguf"))):
        problems.append(
            f"model: {cfg.model} is a GGUF checkpoint; the {cfg.backend} weight cache shares "
            "safetensors-loaded weights only; convert it to safetensors or use another server"
        )
    elif not (model / "config.json").is_file():
        problems.append(f"model: {model} has no config.json (not a checkpoint directory)")
    if cfg.pipeline_parallel_size > 1 and retained:
        problems.append(
            f"pipeline_parallel_size: {cfg.pipeline_parallel_size} is not supported with the "
            f"{cfg.backend} weight cache under hostd (one upstream socket per tensor-parallel GPU); "
            "set it to 1"
        )
    if cfg.tensor_parallel_size != len(cfg.gpus) and cfg.device == "cuda":
        problems.append(
            f"tensor_parallel_size: {cfg.tensor_parallel_size} does not match the {len(cfg.gpus)} "
            f"GPU(s) in gpus: {cfg.gpus}; one replica spans exactly the listed GPUs "
            "(more than one replica is not supported)"
        )
    env = effective_env(cfg)
    for name in ALLOC_CONF_VARIABLES if retained else ():
        if "expandable_segments:true" in env.get(name, "").replace(" ", "").lower():
            problems.append(
                f"env.{name}: expandable_segments:True makes allocations CUDA IPC cannot "
                f"share, and the {cfg.backend} weight cache refuses it; remove that option"
            )
    for where in ("extra_args", "engine_extra_args"):
        args = getattr(cfg, where)
        for flag, why in {**COMMON_REFUSED_FLAGS, **refused_flags}.items():
            if has_flag(args, flag, aliases=aliases):
                problems.append(f"{where}: {flag} is refused: {why}")
        for flag, key in {**COMMON_OWNED_FLAGS, **owned_flags}.items():
            if has_flag(args, flag, aliases=aliases):
                problems.append(f"{where}: {flag} is set by hostd from {key}; set that key instead")
        for flag, key in editable_flags.items():
            if has_flag(args, flag, aliases=aliases):
                problems.append(
                    f"{where}: {flag} is the editable engine.{key}; set engine.{key} so that "
                    "a reload can change it"
                )
    return problems


def quantization_refusals(cfg, allowlist: dict[Optional[str], str], check_fp8_block: bool) -> list[str]:
    """Refuse quantization methods outside ALLOWLIST, configured or declared by
    the checkpoint. With CHECK_FP8_BLOCK, fp8 must be block-wise
    (quantization_config.weight_block_size in config.json)."""
    declared = checkpoint_quantization(cfg.model) or {}
    method = cfg.quantization or declared.get("quant_method")
    key = "quantization" if cfg.quantization else "model (config.json quantization_config.quant_method)"
    if method not in allowlist:
        allowed = ", ".join(repr(m) if m else "none" for m in allowlist)
        return [
            f"{key}: {method!r} is not verified for IPC sharing by the {cfg.backend} weight "
            "cache: its post-load repacking cannot be carried by tensor export and would serve "
            f"wrong numerics (allowed: {allowed})"
        ]
    if method == "fp8" and check_fp8_block and not declared.get("weight_block_size"):
        return [
            f"{key}: 'fp8' is shared only block-wise, and {cfg.model}/config.json has no "
            "quantization_config.weight_block_size (online or per-tensor fp8 is repacked after "
            "loading)"
        ]
    return []


@functools.lru_cache(maxsize=16)
def _probe_version(argv: tuple[str, ...], env_items: tuple[tuple[str, str], ...], stamp: float) -> str:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=120, env=dict(env_items),
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        raise RuntimeError((result.stderr or result.stdout).strip().splitlines()[-1:] or ["failed"])
    return result.stdout.strip()


def version_refusal(what: str, argv: list[str], env: dict[str, str], minimum: tuple[int, ...],
                    how_to_fix: str, why_minimum: str = "the first with the weight cache") -> Optional[str]:
    """Why the upstream program at ARGV[0] cannot be used (missing, broken or
    older than MINIMUM, which WHY_MINIMUM explains), or None. ARGV prints the version."""
    executable = argv[0]
    try:
        stamp = os.stat(executable).st_mtime
    except OSError:
        return f"{what}: {executable} does not exist; {how_to_fix}"
    try:
        text = _probe_version(tuple(argv), tuple(sorted(env.items())), stamp)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        asked = f"{argv[0]} reading {what}'s metadata" if argv[1:2] == ["-c"] else f"`{' '.join(argv)}`"
        return f"{what}: {asked} failed ({exc}); {how_to_fix}"
    found = found_version(text)
    if found is None or found < Version(".".join(map(str, minimum))):
        wanted = ".".join(map(str, minimum))
        return f"{what}: version {text or 'unknown'!r} is older than {wanted}, {why_minimum}; {how_to_fix}"
    return None


def kv_bytes_per_token(cfg) -> Optional[int]:
    """Bytes of KV cache one token of CFG's checkpoint takes on one tensor-parallel
    rank (hostd/kv_bytes.py, the rule the builtin engine's budget uses too);
    None when it cannot be counted (kv_size_problem says why)."""
    try:
        return kv_bytes.for_checkpoint(cfg.model, cfg.dtype, tensor_parallel_size=cfg.tensor_parallel_size)
    except ValueError:
        return None


def kv_size_problem(cfg) -> Optional[str]:
    """Why the KV bytes per token of CFG's checkpoint cannot be counted, naming
    the file and key, or None."""
    try:
        kv_bytes.for_checkpoint(cfg.model, cfg.dtype, tensor_parallel_size=cfg.tensor_parallel_size)
    except ValueError as error:
        return str(error)
    return None


# What a bridge engine holds beside its KV cache and the shared weights, per
# GPU: the CUDA context (about 0.5 GiB, outside PyTorch's accounting), the
# profile run's activation peak (vLLM's "torch peak memory increase", about
# 1.2 GiB for a 7B model at 8192 batched tokens), CUDA graphs (vLLM logs
# "Graph capturing finished ... took 0.3-0.6 GiB") and non-torch allocations
# (NCCL buffers under tensor parallelism). An estimate from upstream's own log
# lines, not measured here (no GPU runs these versions: UPSTREAM.md); on CPU
# it stands for the API server and engine core processes (torch imported
# twice) beside the KV.
BRIDGE_NON_KV_BYTES = 3 << 30


@dataclass(frozen=True)
class Bridge:
    """The budget of the bridge: the engine an overlap reload starts in the
    next slot, beside the serving one, with the new config's editable values
    and a small KV cache of its own (docs/operations.md, The bridge engine)."""

    kv_bytes: int  # reload.bridge_kv_mib: per GPU, or of host memory on CPU
    gpu_total: Optional[int] = None  # the smallest GPU's memory, when NVML tells
    weights_bytes: int = 0  # per GPU: the checkpoint's share, for vLLM's memory check


# Prints PACKAGE's installed version from its metadata, or (not installed in
# this interpreter) runs sys.argv[1] --version and exits with its status.
_METADATA_VERSION = (
    "import importlib.metadata as m, subprocess, sys\n"
    "try:\n    print(m.version({package!r}))\n"
    "except m.PackageNotFoundError:\n    sys.exit(subprocess.run([sys.argv[1], '--version']).returncode)\n"
)


def console_script_python(executable: str) -> Optional[str]:
    """The Python interpreter a pip console script EXECUTABLE names on its #!
    line (an absolute path to an existing python*), or None: a wrapper, a
    binary, `#!/usr/bin/env python3` or no file at all."""
    try:
        with open(executable, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    if len(words) != 1 or not os.path.isabs(words[0]) or not os.path.basename(words[0]).startswith("python"):
        return None
    return words[0] if os.path.isfile(words[0]) else None


def version_argv(executable: str, package: str) -> list[str]:
    """What prints the version of PACKAGE that the console script EXECUTABLE
    runs. `EXECUTABLE --version` imports the package (vLLM: about 20 s on a
    CPU, at each start of each of a model's units); the script's own
    interpreter reads the same installation's metadata in a tenth of a
    second. Anything but a plain pip console script is asked --version."""
    python = console_script_python(executable)
    if python is None:
        return [executable, "--version"]
    return [python, "-c", _METADATA_VERSION.format(package=package), executable]


def find_executable(override_var: str, name: str, env: dict[str, str]) -> str:
    """The upstream executable: $OVERRIDE_VAR if set, else NAME on PATH, else NAME."""
    override = env.get(override_var)
    if override:
        return override
    return shutil.which(name, path=env.get("PATH")) or name


class UpstreamBackend(Backend):
    """A backend whose weights and engine are upstream's own programs, run as
    children of hostd's supervisors (hostd/weights/upstream.py,
    hostd/engine/upstream.py). run_weights/run_engine hand the supervisor
    this backend, which it asks what to run and how to tell that the
    children serve; a supervisor never looks a backend up."""

    # SGLang's daemon writes {device_uuid}.ready once a rank serves; its socket
    # alone appears earlier. vLLM's daemon has no such file: its socket is it.
    writes_ready_files: ClassVar[bool] = False

    # Seconds past drain_seconds() before the engine supervisor SIGKILLs the
    # server: vLLM ends its own drain (--shutdown-timeout) and gets time to exit.
    stop_grace_seconds: ClassVar[float] = 0.0

    # What the engine supervisor asks upstream's server to tell that it serves:
    # a GET that answers at once (never one that generates).
    health_path: ClassVar[str] = "/health"
    health_timeout: ClassVar[float] = 10.0

    # Upstream's log lines that say where its start is (loading, compiling, the KV
    # cache, graph capture): the engine supervisor relays them to STATUS=.
    phase_lines: ClassVar[tuple[re.Pattern, ...]] = ()

    @abc.abstractmethod
    def version_argv(self, cfg) -> list[str]:
        """What prints the version of the upstream installation CFG runs."""

    def upstream_version(self, cfg) -> str:
        """The version upstream's installation prints (probed once per
        executable and mtime, as install_refusals' check), '' when it cannot."""
        argv = self.version_argv(cfg)
        try:
            text = _probe_version(tuple(argv), tuple(sorted(effective_env(cfg).items())), os.stat(argv[0]).st_mtime)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            return ""
        found = found_version(text)
        return str(found) if found is not None else ""

    def run_weights(self, args, cfg) -> int:
        from hostd.weights import upstream as supervisor

        return supervisor.run(args, cfg, self)

    def run_engine(self, args, cfg) -> int:
        from hostd.engine import upstream as supervisor

        return supervisor.run(args, cfg, self)

    # Quantization methods upstream's weight cache can share, with the reason
    # (set by each backend); fp8 only block-wise where FP8_BLOCK_ONLY.
    QUANTIZATION_ALLOWLIST: ClassVar[dict[Optional[str], str]] = {None: "unquantized"}
    FP8_BLOCK_ONLY: ClassVar[bool] = False

    def uses_gpu(self, cfg) -> bool:
        return cfg.device == "cuda"

    def weights_not_retained(self, cfg) -> Optional[str]:
        """Why upstream's weight cache cannot hold CFG's weights, so that the
        engine loads them from disk on every start, or None."""
        if cfg.weight_cache == "off":
            return "weight_cache: off in the model's config"
        if cfg.device == "cpu":
            return (f"device: cpu; the {cfg.backend} weight cache shares weights through CUDA IPC "
                    "only (upstream raises UnsupportedPlatformForIPCError on other platforms)")
        problems = quantization_refusals(cfg, self.QUANTIZATION_ALLOWLIST, check_fp8_block=self.FP8_BLOCK_ONLY)
        return problems[0] if problems else None

    def retains_weights(self, cfg) -> bool:
        return self.weights_not_retained(cfg) is None

    def expected_sockets(self, cfg) -> int:
        """Upstream sockets that exist once every rank serves: one per GPU."""
        return cfg.tensor_parallel_size

    @abc.abstractmethod
    def socket_devices(self, names: list[str], cfg) -> list[str]:
        """The GPUs (UUIDs, or what upstream's socket NAMES tell of them) behind
        the upstream sockets: the fingerprint's device."""

    @abc.abstractmethod
    def socket_dir(self, model: str, slot: str = "main") -> Path:
        """/run/hostd/MODEL/<dir>: the sockets, ready and lock files of the
        upstream daemon of weight slot SLOT (main; next: a checkpoint swap's)."""

    @abc.abstractmethod
    def weights_command(self, model: str, cfg, slot: str = "main") -> Command:
        """What hostd's weights supervisor of weight slot SLOT runs as its
        child, its sockets in socket_dir(model, SLOT)."""

    @abc.abstractmethod
    def engine_command(self, model: str, cfg, port: int = 0, slot: str = "main",
                       bridge: Optional[Bridge] = None, weights_slot: str = "main") -> Command:
        """What hostd's engine supervisor of SLOT runs as its child; PORT is
        the private loopback port it picked when engine_socket() is None.
        With BRIDGE (the next slot; the standby's, standby_command) the engine
        runs on that budget. WEIGHTS_SLOT: the weight daemon it attaches
        (next: a checkpoint swap's engine, on the new checkpoint's daemon)."""

    # ------------------------------------------------------------ the bridge

    def bridge(self, cfg) -> Bridge:
        """The next slot's budget for CFG (read where the engine runs: NVML)."""
        total = nvml.smallest_total(cfg.gpus) if cfg.device == "cuda" else None
        weights = checkpoint_bytes(cfg.model) // max(1, cfg.tensor_parallel_size)
        return Bridge(cfg.reload.bridge_kv_mib << 20, total, weights)

    def bridge_need(self, cfg) -> int:
        """KV budget + BRIDGE_NON_KV_BYTES, plus the weights where the bridge
        loads its own copy from disk (not retained: CPU, weight_cache off)."""
        need = (cfg.reload.bridge_kv_mib << 20) + BRIDGE_NON_KV_BYTES
        if not self.retains_weights(cfg):
            need += checkpoint_bytes(cfg.model) // (1 if cfg.device == "cpu" else max(1, cfg.tensor_parallel_size))
        return need

    # Variables the bridge's command removes (Command.unset): each would
    # override its KV budget.
    bridge_cleared_env: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def bridge_args(self, cfg, bridge: Bridge) -> list[str]:
        """The flags that put the bridge on BRIDGE's budget (after all others)."""

    def bridge_env(self, cfg) -> dict[str, str]:
        """Variables the bridge's command sets on top of the model's env:."""
        return {}

    def bridge_summary(self, cfg, bridge: Bridge) -> str:
        """What the bridge runs with, for the Operation's notes and the journal."""
        return " ".join([*self.bridge_args(cfg, bridge), *(f"-u {name}" for name in self.bridge_cleared_env),
                         *(f"{name}={value}" for name, value in sorted(self.bridge_env(cfg).items()))])

    # ------------------------------------------------------------ the standby

    # Engine keys whose change alters which requests the engine accepts or
    # what it answers them (vLLM's max_model_len: a longer prompt is refused
    # below it). A standby kept on an older value would answer a failover's
    # requests differently from the main engine, so a reload that changes one
    # restarts it on the new config afterwards; every other key is a capacity
    # or speed setting, and the standby keeps serving the one it started with.
    standby_answer_keys: ClassVar[frozenset[str]] = frozenset()

    def standby_command(self, model: str, cfg, budget: Bridge, port: int = 0) -> Command:
        """The warm standby's engine (slot "standby", `standby: true`): the
        main engine's command on an upstream socket or PORT of its own,
        attached to the same weight cache daemon as the main engine and the
        bridge, on the bridge's small KV budget. BUDGET is the bridge's
        (bridge(cfg): reload.bridge_kv_mib), not a key of its own: a vLLM or
        SGLang engine cannot grow its KV pool without a restart, so the budget
        the standby waits on is the one it serves a failover or a reload with,
        which is the bridge's job and the room bridge_need() already weighs
        (docs/vllm.md, The standby)."""
        return self.engine_command(model, cfg, port=port, slot="standby", bridge=budget)

    def standby_restart_reason(self, running: dict, target: dict) -> Optional[str]:
        """Why a standby that runs the engine section RUNNING (its /health)
        must restart to serve TARGET (the section the main engine serves
        after a reload): the standby_answer_keys that differ, named; None
        when it serves TARGET's requests as it is (only capacity differs)."""
        changed = sorted(key for key in self.standby_answer_keys if running.get(key) != target.get(key))
        if not changed:
            return None
        return ", ".join(f"{key} {running.get(key)!r} -> {target.get(key)!r}" for key in changed)

    def gpu_free(self, cfg) -> dict[int, int]:
        """{GPU index: free bytes} of CFG's GPUs by NVML; empty on CPU or without NVML."""
        return {i: info.free for i, info in nvml.memory(list(cfg.gpus)).items()} if self.uses_gpu(cfg) else {}

    def room_problem(self, cfg, who: str, host_available: Optional[int], gpu_free: dict[int, int],
                     weights: int = 0) -> Optional[str]:
        """Why a second upstream server of CFG on the bridge's budget (WHO:
        the overlap's bridge engine, the warm standby) does not fit beside
        what runs, or None. Its need is bridge_need() (reload.bridge_kv_mib,
        the non-KV footprint, the weights where it loads them from disk), plus
        reload.overlap_reserve_mib and WEIGHTS (per GPU, or of the host: a
        checkpoint swap's second weight daemon), against each GPU's free
        memory in GPU_FREE (NVML; none listed: not weighed here) or, on CPU,
        HOST_AVAILABLE (MemAvailable; None: not weighed here)."""
        need = self.bridge_need(cfg)
        reserve = (cfg.reload.overlap_reserve_mib << 20) + weights
        kept = f"reload.overlap_reserve_mib={cfg.reload.overlap_reserve_mib}"
        if weights:
            kept = f"the new checkpoint's weights ({weights >> 20} MiB) and {kept}"
        what = (f"the {who} needs about {need >> 20} MiB (reload.bridge_kv_mib={cfg.reload.bridge_kv_mib} "
                "of KV and its non-KV footprint"
                + ("" if self.retains_weights(cfg) else ", and its own copy of the weights")
                + f") and {kept} must stay free")
        if self.uses_gpu(cfg):
            for index, free in gpu_free.items():
                if need + reserve > free:
                    return f"GPU {index}: {what}, but {free >> 20} MiB are free"
            return None
        if host_available is not None and need + reserve > host_available:
            return f"{what}, but MemAvailable is {host_available >> 20} MiB"
        return None

    def standby_fit_problem(self, cfg, host_available: Optional[int], gpu_free: dict[int, int]) -> Optional[str]:
        """Why the standby of CFG does not fit beside what runs (the preflight
        its engine runs before it starts upstream): room_problem, with what
        to change; None when it fits or NVML or /proc cannot tell (upstream's
        own start check still guards)."""
        problem = self.room_problem(cfg, "standby", host_available, gpu_free)
        return f"{problem}; lower reload.bridge_kv_mib or set standby: false" if problem else None
