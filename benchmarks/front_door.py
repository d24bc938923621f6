"""Benchmark: what one cheap attacker does to everyone else at the gateway's front door.

Starts an engine double (tests/doubles/engine_double.py: answers at once, so
only the gateway is measured) and two gateways in front of it on their own
ports, one from --baseline CHECKOUT (another commit's tree, run with
PYTHONPATH=CHECKOUT) and one from this checkout, both with the default
`gateway:` limits. Each attack runs against the baseline, then against this
checkout, in one run, and the table gives, for each: what the attack cost the
attacker, what a legitimate client on another source address (127.0.0.2, a
fresh connection per request) saw meanwhile (status codes, p50/p99), and the
gateway's RSS and CPU seconds during the attack (utime + stime).

Attacks (issue 22's items):

- bodies (1): 4 connections each send the headers of a 32 MiB POST and nothing else;
- stalled readers (3): 4 clients start a large stream and stop reading; then a
  drain (45 s timeout) as a restart reload does it: does it end, and when;
- idle keep-alive (4): max_connections (1024) connections, each one GET /health, then idle;
- gzip bombs (5): 4 clients in a loop POST 1 MiB gzip bodies (1 GiB inflated) to an unknown route;
- unfinished headers (10): 300 connections each send 96 header fields of
  8000 bytes and never end the head.

    python benchmarks/front_door.py --baseline /tmp/hostd-before
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import httpx

# The harness that runs a model's daemons by hand lives beside the tests
# (harness/local.py): put the checkout on the path to import it.
HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness.local import ModelTree, cpu_seconds, free_port, wait_for  # noqa: E402

MiB = 1 << 20
DOUBLE = HERE / "tests" / "doubles" / "engine_double.py"
LEGIT = "127.0.0.2"
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Gateway:
    def __init__(self, label: str, tree: ModelTree, checkout: Path):
        self.label = label
        self.port = free_port()
        self.control_socket = tree.root / label / "control.sock"  # a private directory of its own
        self.log = open(tree.root / f"{label}-gateway.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hostd.main", "gateway", tree.name, "--listen", f"127.0.0.1:{self.port}",
             "--control", str(self.control_socket)],
            env={**tree.env(), "PYTHONPATH": str(checkout)}, cwd=checkout, stdout=self.log,
            stderr=subprocess.STDOUT)
        wait_for(lambda: self.status().get("state") == "serving", 60, f"{label} gateway serving", self.proc)

    def control(self, request: dict, timeout: float = 60) -> dict:
        try:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(timeout)
                conn.connect(str(self.control_socket))
                conn.sendall(json.dumps(request).encode() + b"\n")
                return json.loads(conn.makefile("rb").readline() or b"{}")
        except OSError:
            return {}

    def status(self) -> dict:
        return self.control({"verb": "status"}, 5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def legit(port: int, runs: int) -> tuple[dict, float, float]:
    """RUNS completions from LEGIT, a fresh connection each, 5 s at most each:
    (answers by status, 'error' for none), p50 ms, p99 ms)."""
    codes: dict[str, int] = {}
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        try:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=LEGIT), timeout=5) as http:
                code = str(http.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION).status_code)
        except httpx.HTTPError:
            code = "error"
        times.append((time.perf_counter() - started) * 1000)
        codes[code] = codes.get(code, 0) + 1
    times.sort()
    return codes, statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def connect(port: int, data: bytes = b"", rcvbuf: int = 0) -> socket.socket:
    conn = socket.socket()
    if rcvbuf:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    conn.settimeout(30)
    conn.connect(("127.0.0.1", port))
    if data:
        conn.sendall(data)
    return conn


# ---------------------------------------------------------------- attacks: each returns (cost, note, cleanup)


def bodies(gw: Gateway):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 33554432\r\n\r\n"
    held = [connect(gw.port, head) for _ in range(4)]
    time.sleep(0.5)
    return f"4 connections, {4 * len(head)} bytes", "", held


def stalled_readers(gw: Gateway):
    body = json.dumps({**COMPLETION, "stream": True, "max_tokens": 100000, "pad": 65536}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    held = [connect(gw.port, head + body, rcvbuf=4096) for _ in range(4)]
    wait_for(lambda: gw.status().get("in_flight") == 4, 30, "4 streams admitted")
    started = time.monotonic()
    drained = gw.control({"verb": "drain", "timeout": 45}, 90)
    took = time.monotonic() - started
    gw.control({"verb": "resume"})
    note = (f"drain ended after {took:.1f} s: drained {drained.get('drained')}, "
            f"{drained.get('remaining')} still running")
    return f"4 connections, {4 * (len(head) + len(body))} bytes, then no reads", note, held


def idle_keep_alive(gw: Gateway):
    held = []
    for _ in range(1024):
        try:
            conn = connect(gw.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"}"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                answer += chunk
            held.append(conn)
        except OSError:
            break
    return f"{len(held)} connections, one GET /health each", "", held


_BOMB: list[bytes] = []


def bomb() -> bytes:
    """1 GiB of zeros, gzip-compressed (about 1 MiB), made once."""
    if not _BOMB:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        zeros = bytes(16 * MiB)
        _BOMB.append(b"".join(packer.compress(zeros) for _ in range(64)) + packer.flush())
    return _BOMB[0]


def gzip_bombs(gw: Gateway):
    body = bomb()
    head = (b"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    stop = threading.Event()
    sent = [0]

    def attacker() -> None:
        while not stop.is_set():
            try:
                with connect(gw.port) as conn:
                    conn.sendall(head + body)
                    sent[0] += 1
                    conn.recv(4096)
            except OSError:
                pass

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1)

    class Stopper:
        def close(self) -> None:
            stop.set()
            for t in threads:
                t.join(30)

    return f"4 clients in a loop, {len(body) // 1024} KiB a bomb", (lambda: f"{sent[0]} bombs sent"), [Stopper()]


def unfinished_headers(gw: Gateway):
    held = []
    field = b"X-Pad: " + b"a" * 8000 + b"\r\n"
    for _ in range(300):
        try:
            conn = connect(gw.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            for _ in range(96):
                conn.sendall(field)
            held.append(conn)
        except OSError:
            held.append(conn)  # answered (431) and closed while sending
    time.sleep(1)
    return f"300 connections, {300 * 96 * len(field) // MiB} MiB of headers", "", held


ATTACKS = {"bodies (1)": bodies, "stalled readers (3)": stalled_readers, "idle keep-alive (4)": idle_keep_alive,
           "gzip bombs (5)": gzip_bombs, "unfinished headers (10)": unfinished_headers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT", required=True,
                        help="the 'before' checkout (e.g. git worktree add /tmp/hostd-before b87e2d5)")
    parser.add_argument("--runs", type=int, default=30, help="legitimate requests during each attack")
    parser.add_argument("--only", action="append", choices=sorted(ATTACKS), help="run only these attacks")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the attack's connections

    workdir = Path(tempfile.mkdtemp(prefix="hostd-door-bench-"))
    tree = ModelTree(workdir)
    tree.write_config(workdir / "no-checkpoint", fixed={"listen": f"127.0.0.1:{free_port()}"}, max_num_seqs=4)
    from hostd import sockets

    sockets.ensure_private_dir(tree.runtime_dir)
    engine = subprocess.Popen([sys.executable, str(DOUBLE), str(tree.engine_socket), "--log", os.devnull],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rows = []
    gateways: list[Gateway] = []
    try:
        wait_for(lambda: tree._connectable(tree.engine_socket), 30, "engine double", engine)
        for label, checkout in (("before", args.baseline.resolve()), ("after", HERE)):
            gateways.append(Gateway(label, tree, checkout))
        for gw in gateways:
            codes, p50, p99 = legit(gw.port, args.runs)
            rows.append(("no attack", "none", gw.label, codes, p50, p99, rss_mib(gw.proc.pid), None, ""))
        for name, attack in ATTACKS.items():
            if args.only and name not in args.only:
                continue
            for gw in gateways:
                cpu0 = cpu_seconds(gw.proc.pid)
                cost, note, held = attack(gw)
                codes, p50, p99 = legit(gw.port, args.runs)
                rss, cpu = rss_mib(gw.proc.pid), cpu_seconds(gw.proc.pid) - cpu0
                for conn in held:
                    conn.close()
                note = note() if callable(note) else note
                rows.append((name, cost, gw.label, codes, p50, p99, rss, cpu, note))
                wait_for(lambda: gw.status().get("state") == "serving" and gw.status().get("in_flight") == 0,
                         120, f"{gw.label} gateway idle again")
                time.sleep(1)
    finally:
        for gw in gateways:
            gw.stop()
        engine.terminate()
        engine.wait(10)

    print(f"\nA legitimate client from {LEGIT}: {args.runs} completions during each attack, a fresh connection "
          "each, 5 s at most each ('error': no answer); gateway RSS at the end of the attack, CPU seconds "
          "during it\n")
    print("| attack (issue 22 item) | attacker's cost | gateway | legitimate answers | p50 ms | p99 ms "
          "| gateway RSS MiB | gateway CPU s | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, cost, label, codes, p50, p99, rss, cpu, note in rows:
        answers = ", ".join(f"{c}: {k}" for c, k in sorted(codes.items()))
        cpu_text = "—" if cpu is None else f"{cpu:.2f}"  # measured during an attack only
        print(f"| {name} | {cost} | {label} | {answers} | {p50:.1f} | {p99:.1f} | {rss:.0f} | {cpu_text} | {note} |")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
