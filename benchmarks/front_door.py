"""Benchmark: the gateway's public side under idle connections and slow large bodies.

Starts a weight daemon, a builtin engine and a gateway on a tiny random model
(CPU), then:

- idle: opens N connections that never send a byte and holds them, then times
  the control socket's `status` and a real client's GET /v1/models (a fresh
  connection each, p50/p99), and reads the gateway's RSS;
- bodies: M clients each announce a body of --body-mib MiB, send all but one
  MiB of it and stop; reads the gateway's RSS and counts the clients the
  gateway answered at once (503/413) and what the control socket says is in
  flight.

Works against an older checkout too (PYTHONPATH=that checkout): it only sets
the gateway keys that checkout's schema knows.

    python benchmarks/front_door.py --idle 1200 --bodies 12 --body-mib 32
"""

from __future__ import annotations

import argparse
import resource
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hostd.checkpoints.random_model import write_checkpoint
from hostd.config import schema

# The harness that runs a model's daemons by hand lives beside the tests
# (tests/local.py): put the checkout on the path to import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.local import ModelTree, wait_for  # noqa: E402

MiB = 1 << 20


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn, runs: int) -> tuple[float, float, int]:
    """(p50 ms, p99 ms, failures) of RUNS calls of FN, each bounded to 5 s."""
    times, failures = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        try:
            fn()
        except Exception:
            failures += 1
            continue
        times.append((time.perf_counter() - started) * 1000)
    if not times:
        return float("nan"), float("nan"), failures
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))], failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=1200, help="idle connections to hold")
    parser.add_argument("--bodies", type=int, default=12, help="slow clients with large bodies")
    parser.add_argument("--body-mib", type=int, default=32)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="hostd-door-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    known = set(schema.GatewayConfig.__struct_fields__)
    gateway = {k: v for k, v in {"header_timeout": 600, "body_timeout": 600,
                                 "max_body_bytes": args.body_mib * MiB}.items() if k in known}
    tree = ModelTree(workdir, name="bench")
    tree.write_config(write_checkpoint(workdir / "ckpt"), fixed={"listen": f"127.0.0.1:{port}", "gateway": gateway},
                      max_num_seqs=4)
    rows = []
    held: list[socket.socket] = []
    try:
        tree.start_weights()
        tree.start_engine()
        gw = tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
        url = f"http://127.0.0.1:{port}/v1/models"

        def control():
            with socket.socket(socket.AF_UNIX) as conn:  # hostd's client waits 30 s; 5 s is a failure here
                conn.settimeout(5)
                conn.connect(str(tree.control_socket))
                conn.sendall(b'{"verb": "status"}\n')
                if b'"ok": true' not in conn.makefile("rb").readline():
                    raise RuntimeError("no status")

        statuses: dict[int, int] = {}

        def client():
            code = httpx.get(url, timeout=5).status_code
            statuses[code] = statuses.get(code, 0) + 1

        # This process holds the idle connections; the daemons keep the limit
        # they started with (run under `prlimit --nofile=1024:HARD` to see
        # systemd's default soft limit).
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        base_rss = rss_mib(gw.pid)
        rows.append(("no load", 0, *timed(control, args.runs), *timed(client, args.runs), base_rss,
                     dict(statuses)))
        statuses.clear()
        for _ in range(args.idle):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(1)
        rows.append((f"{args.idle} idle connections", len(held), *timed(control, args.runs),
                     *timed(client, args.runs), rss_mib(gw.pid), dict(statuses)))
        for conn in held:
            conn.close()
        held.clear()
        wait_for(lambda: httpx.get(url, timeout=5).status_code == 200, 60, "serving after the idle test")

        before = rss_mib(gw.pid)
        answered = 0
        for _ in range(args.bodies):
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (args.body_mib * MiB))
            held.append(conn)
        chunk = b" " * MiB
        for conn in held:
            try:
                for _ in range(args.body_mib - 1):
                    conn.sendall(chunk)
            except OSError:
                pass
        time.sleep(2)
        for conn in held:
            conn.settimeout(0.2)
            try:
                if conn.recv(64).startswith(b"HTTP/1.1 "):
                    answered += 1
            except OSError:
                pass
        in_flight = tree.control("status")["in_flight"]
        body_row = (args.bodies, args.body_mib, before, rss_mib(gw.pid), answered, in_flight)
    finally:
        for conn in held:
            conn.close()
        tree.stop_all()

    print(f"\nIdle connections ({args.runs} calls each, ms to an answer; a failure is a call that errored or "
          "took over 5 s; client answers by HTTP status)\n")
    print("| load | connections held | control p50 | control p99 | control failures | client p50 | client p99 "
          "| client failures | client answers | gateway RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        name, n, cp50, cp99, cf, hp50, hp99, hf, rss, codes = row
        answers = ", ".join(f"{c}: {k}" for c, k in sorted(codes.items())) or "none"
        print(f"| {name} | {n} | {cp50:.2f} | {cp99:.2f} | {cf} | {hp50:.2f} | {hp99:.2f} | {hf} | {answers} "
              f"| {rss:.0f} |")
    n, mib, rss0, rss1, answered, in_flight = body_row
    print(f"\nSlow large bodies: {n} clients each send {mib - 1} of {mib} MiB and stop\n")
    print("| gateway RSS before MiB | gateway RSS after MiB | clients answered at once | admitted (in flight) |")
    print("|---|---|---|---|")
    print(f"| {rss0:.0f} | {rss1:.0f} | {answered} | {in_flight} |")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
