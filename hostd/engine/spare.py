"""hostd engine-spare NAME: the pre-imported spare of a builtin model's main engine (`spare: true`).

One job: keep a process whose imports are done, and fork engines from it.
An engine's start on the H200 was 13 s, 11 of them imports (docs/benchmarks.md);
the weights attach in hundredths of a second.

Runs in model-engine-spare@NAME. At start it reads the model's config and
imports what an engine's start imports: torch, transformers, hostd's engine,
the model's own modeling module (by building the model on the meta device)
and its tokenizer's. Never CUDA (a forked CUDA context is unusable) and no
weights: it holds nothing on a GPU. Then READY=1, and it listens on
/run/hostd/NAME/engine-spare.sock (0600: the model's user).

A request (one JSON line from handoff.py, the main engine's start: its
argv, its start clock) is answered by a fork. The child forks once more and
exits, so the engine's process is reparented to PID 1, its parent as of any
process systemd starts: systemd reaps it and reads its exit status, so
Restart=on-failure works as for a process systemd forked. That process says
its pid, uid, environment and code stamp, and waits for one word: "go"
(handoff.py made it model-engine@NAME's main process) or anything else,
the connection's end included (it exits). On "go" it opens a journal stream
of its own from the engine's cgroup (journald files its stdout and stderr
under model-engine@NAME, as it files the native log lines by their sender),
takes the engine's per-invocation variables and runs the engine as `hostd
engine NAME` would (dispatch.run), with the engine's start clock.

Trusts: a peer of its own uid (SO_PEERCRED; the socket is 0600 too).
Refuses a request that is not one JSON object line within REQUEST_LIMIT.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import hostd
from hostd import logs, paths, sockets, systemd
from hostd import config as hostd_config
from hostd.engine import handoff

log = logging.getLogger("hostd.spare")

# The environment systemd gave the spare, before any import set variables of
# its own (torch's and hostd's caches): what an engine forked from it starts with.
UNIT_ENVIRONMENT = dict(os.environ)
CONFIG_REFUSED = 78  # the unit's RestartPreventExitStatus=: starting again would not change it
REQUEST_LIMIT = 64 << 10  # bytes of a request line: an argv and a clock
ANSWER_WAIT = 60.0  # seconds the forked process waits for "go" before it gives up


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="model name (/etc/hostd/models/NAME.yaml)")
    parser.add_argument("--socket", metavar="PATH", help="listen here (default /run/hostd/NAME/engine-spare.sock)")


def preimport(cfg) -> None:
    """Import what an engine's start imports (hostd/engine/main.py's serve),
    touching no GPU."""
    from hostd.weights import checkpoint  # first: applies the lean import policy (weights/lean.py)

    import torch
    from transformers import AutoTokenizer

    for module in ("hostd.engine.main", "hostd.engine.server"):  # serve()'s own imports, and what they pull
        importlib.import_module(module)

    model_dir = Path(cfg.model)
    # transformers imports a model's modeling module when it first builds
    # one: build it on the meta device (no memory) so the engine need not.
    checkpoint.build_skeleton(model_dir, checkpoint.resolve_dtype(model_dir, cfg.dtype), meta_buffers=True)
    AutoTokenizer.from_pretrained(cfg.model)  # its tokenizer's modules, the same way
    if torch.cuda.is_initialized() or cuda_opened():
        raise RuntimeError("the spare initialised CUDA, which a forked process cannot use")


def cuda_opened() -> bool:
    """Has this process opened a GPU (a descriptor on /dev/nvidia*)? CUDA's
    driver does at its initialisation (torch's first CUDA call, or
    torch.cuda.is_available(), which transformers may call), and a forked
    engine could not use what it inherits. libcuda merely mapped is no sign:
    on the H200 `import torch` maps it and forked engines run (2026-12-04)."""
    fds = Path("/proc/self/fd")
    for fd in fds.iterdir():
        try:
            if os.readlink(fd).startswith("/dev/nvidia"):
                return True
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return False


def run(args: argparse.Namespace) -> int:
    logs.setup(args.name, "spare")
    root = hostd_config.config_root(args.config_dir)
    cfg = hostd_config.load_model(args.name, root).config
    logs.apply_level(hostd_config.load_daemon(root).log_level)
    if not getattr(cfg, "spare", False):  # a key of the builtin backend's models only (config/schema.py)
        log.error("the config of %s does not say spare: true", args.name)
        systemd.status("refused: the model's config does not say spare: true")
        return CONFIG_REFUSED
    systemd.status("importing")
    stamp = handoff.code_stamp()  # before the imports: an upgrade meanwhile is then seen
    try:
        preimport(cfg)
    except (OSError, ValueError, RuntimeError) as exc:
        log.error("the spare of %s cannot prepare: %s", args.name, exc)
        systemd.status(f"failed: {exc}")
        return 1
    listener = listen(Path(args.socket) if args.socket else paths.spare_socket(args.name))
    took = time.monotonic() - hostd.STARTED
    log.info("spare of %s ready: imports done in %.2f s, %d threads", args.name, took, threading.active_count())
    systemd.notify("READY=1", f"STATUS=ready to start the engine of {args.name} (imports took {took:.1f} s)")
    while True:
        conn, _ = listener.accept()
        try:
            serve_request(conn, listener, args.name, stamp)
        except (OSError, ValueError) as exc:
            log.warning("a fork request failed: %s", exc)
        except Exception:  # deep JSON, anything else: this request fails, the spare stays
            log.exception("a fork request failed")
        finally:
            conn.close()


def listen(path: Path) -> socket.socket:
    """PATH, 0600 in a private directory (hostd/sockets.py: a stale socket of
    ours is replaced, a live one or anything else refused)."""
    return sockets.bind_private(path, backlog=4)


def serve_request(conn: socket.socket, listener: socket.socket, name: str, stamp: str) -> None:
    """One request on CONN: check its peer and shape, then fork the engine's process."""
    uid = sockets.peer_credentials(conn)[1]
    if uid != os.getuid():
        raise ValueError(f"refused a request from uid {uid}: only the model's user ({os.getuid()}) may ask")
    conn.settimeout(10)
    request = handoff.read_line(conn, REQUEST_LIMIT)
    if not (isinstance(request, dict) and isinstance(request.get("argv"), list)
            and all(isinstance(a, str) for a in request["argv"]) and isinstance(request.get("started"), (int, float))):
        raise ValueError("refused a request that is not {argv: [strings], started: seconds}")
    if cuda_opened():  # never: preimport() checked; a fork of it would fail at its first CUDA call
        raise ValueError("the spare has opened a GPU; it cannot fork an engine")
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    # In the first child: fork the engine's process and leave it to PID 1.
    # Whatever happens, never back into the spare's loop.
    try:
        if os.fork():
            os._exit(0)
        listener.close()
        code = become_engine(conn, request, first, name, stamp)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        log.exception("the forked engine of %s failed", name)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def become_engine(conn: socket.socket, request: dict, parent: int, name: str, stamp: str) -> int:
    """In the forked process: once reparented, say who it is, wait for "go", then serve."""
    deadline = time.monotonic() + 5
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.001)
    conn.sendall(json.dumps({"pid": os.getpid(), "uid": os.getuid(), "env": UNIT_ENVIRONMENT,
                             "code": stamp}).encode() + b"\n")
    conn.settimeout(ANSWER_WAIT)
    try:
        answer = handoff.read_line(conn, REQUEST_LIMIT)
    except (OSError, ValueError):
        answer = None
    conn.close()
    if not (isinstance(answer, dict) and answer.get("go") is True):
        return 0  # the engine's start refused this process (its journal says why) and starts on its own
    for key in [k for k in os.environ if handoff.per_invocation(k)]:
        os.environ.pop(key)
    os.environ.update({k: v for k, v in answer.get("env", {}).items() if handoff.per_invocation(k)})
    for key in ("SYSTEMD_EXEC_PID", "WATCHDOG_PID", "MAINPID"):  # they named the handing-over process: now this one
        if key in os.environ:
            os.environ[key] = str(os.getpid())
    own_journal_stream()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    hostd.STARTED = request["started"]  # the engine's phases count from its unit's process start
    from hostd import dispatch
    from hostd.main import build_parser

    args = build_parser("engine").parse_args(request["argv"])
    args.from_spare = os.getpid()
    return dispatch.run("engine", args)


def own_journal_stream() -> None:
    """Point stdout and stderr at a journal stream opened from this process,
    now in the engine's cgroup: journald names a stream's unit by its
    opener, and the inherited one was the spare's (sd_journal_stream_fd's
    protocol: identifier, unit, priority, level prefix, three forwards). By
    hand (no JOURNAL_STREAM) stderr stays."""
    if not os.environ.get("JOURNAL_STREAM"):
        return
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stream.connect("/run/systemd/journal/stdout")
        stream.shutdown(socket.SHUT_RD)
        stream.sendall(f"{Path(sys.executable).name}\n\n6\n1\n0\n0\n0\n".encode())
    except OSError as exc:
        log.warning("no journal stream of the engine's own (%s): its stdout stays the spare's", exc)
        stream.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stream.fileno(), 1)
    os.dup2(stream.fileno(), 2)
    stream.close()
    st = os.fstat(2)
    os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
