"""Benchmark: issues 33's and 52's hostile bodies against the builtin stack, through the gateway.

Starts a model's daemons by hand (harness/local.py's ModelTree: the weight
daemon, the builtin engine and the gateway, default limits, no key) on a tiny
random Qwen2 checkpoint with a real BPE tokenizer and chat template
(hostd/checkpoints/random_model.py; --checkpoint for another), then runs each
attack from 127.0.0.1 while a legitimate client on 127.0.0.2 sends one small
chat after another (a fresh connection each, 30 s at most each) and a watcher
asks the gateway's control socket for its state every 0.2 s. For each attack
the table gives what the attacker got and when, the legitimate client's
latencies during the attack against those with no attack, and every gateway
state seen meanwhile (it must stay `serving`).

Attacks (issue 33):

- H2 role: one chat whose one message has a 30 MiB role;
- H2 messages: one chat of 1,000,000 messages {"role": "u"} (about 13 MB);
- M3 bombs: 4 clients in parallel, in a loop for --bomb-seconds, POST a
  1 MiB gzip bomb (1 GiB inflated) to /v1/completions with the fields
  `Content-Encoding: identity` then `Content-Encoding: gzip`.

Attacks (issue 52, H2's residual): one chat of about 31 MiB whose
11,000,000 empty lists are in `messages`, in a field no request type names,
or in the refused `logit_bias`; then the `messages` one from four source
addresses at once (127.0.0.11 to .14).

    python benchmarks/hostile_input.py
    python benchmarks/hostile_input.py --checkout /tmp/hostd-before   # another tree's daemons

Nothing here asserts a time: it prints the figures (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness.local import ModelTree, free_port  # noqa: E402

MiB = 1 << 20
LEGIT = "127.0.0.2"
SMALL_CHAT = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


class Watch:
    """The legitimate client and the state watcher, for the length of one phase."""

    def __init__(self, tree: ModelTree):
        self.tree = tree
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.codes: Counter = Counter()
        self.states: Counter = Counter()
        self.threads = [threading.Thread(target=self._legit, daemon=True),
                        threading.Thread(target=self._states, daemon=True)]

    def __enter__(self) -> "Watch":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _legit(self) -> None:
        url = self.tree.base_url + "/v1/chat/completions"
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                with httpx.Client(transport=httpx.HTTPTransport(local_address=LEGIT), timeout=30) as http:
                    code = str(http.post(url, json=SMALL_CHAT).status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            self.latencies.append((time.perf_counter() - started) * 1000)
            self.codes[code] += 1

    def _states(self) -> None:
        while not self.stop.is_set():
            try:
                self.states[self.tree.control("status")["state"]] += 1
            except Exception as exc:  # no answer is a state too
                self.states[f"no answer ({type(exc).__name__})"] += 1
            self.stop.wait(0.2)


def post(tree: ModelTree, path: str, body: bytes, headers: dict) -> tuple[str, float]:
    """One attacker request from 127.0.0.1: (status or error, seconds)."""
    started = time.perf_counter()
    try:
        with httpx.Client(timeout=600) as http:
            response = http.post(tree.base_url + path, content=body, headers=headers)
            code = f"{response.status_code} ({len(response.content)} bytes) {response.text[:80]!r}"
    except httpx.HTTPError as exc:
        code = type(exc).__name__
    return code, time.perf_counter() - started


def huge_role(tree: ModelTree, _args) -> str:
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "u" * (30 * MiB)}]}).encode()
    code, seconds = post(tree, "/v1/chat/completions", body, {"Content-Type": "application/json"})
    return f"{len(body) // MiB} MiB: {code} after {seconds:.1f} s"


def many_messages(tree: ModelTree, _args) -> str:
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "u"}] * 1_000_000}).encode()
    code, seconds = post(tree, "/v1/chat/completions", body, {"Content-Type": "application/json"})
    return f"{len(body) / 1e6:.0f} MB: {code} after {seconds:.1f} s"


LISTS = b"[" + b"[]," * 10_999_999 + b"[]]"  # 11 M empty lists, about 31 MiB
CHAT = b'{"model": "tiny", "max_tokens": 2, '
HI = b'"messages": [{"role": "user", "content": "hi"}]'


def lists_body(where: str) -> bytes:
    if where == "messages":
        return CHAT + b'"messages": ' + LISTS + b"}"
    return CHAT + HI + b', "%s": ' % where.encode() + LISTS + b"}"


def lists_in(where: str):
    def attack(tree: ModelTree, _args) -> str:
        body = lists_body(where)
        code, seconds = post(tree, "/v1/chat/completions", body, {"Content-Type": "application/json"})
        return f"{len(body) // MiB} MiB: {code} after {seconds:.2f} s"
    return attack


def lists_from_four(tree: ModelTree, _args) -> str:
    body = lists_body("messages")
    answers: list[tuple[str, float]] = []

    def attacker(address: str) -> None:
        started = time.perf_counter()
        try:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=600) as http:
                code = str(http.post(tree.base_url + "/v1/chat/completions", content=body,
                                     headers={"Content-Type": "application/json"}).status_code)
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        answers.append((code, time.perf_counter() - started))

    threads = [threading.Thread(target=attacker, args=(f"127.0.0.{i}",)) for i in range(11, 15)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return f"{len(body) // MiB} MiB x 4: " + ", ".join(f"{c} after {s:.2f} s" for c, s in answers)


def bomb() -> bytes:
    """1 GiB of spaces, gzip-compressed (about 1 MiB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    spaces = b" " * (16 * MiB)
    return b"".join(packer.compress(spaces) for _ in range(64)) + packer.flush()


def double_encoding_bombs(tree: ModelTree, args) -> str:
    body = bomb()
    port = int(tree.base_url.rsplit(":", 1)[1])
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: identity\r\nContent-Encoding: gzip\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    deadline = time.monotonic() + args.bomb_seconds
    answers: Counter = Counter()

    def attacker() -> None:
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                    conn.sendall(head + body)
                    answers[conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace") or "closed"] += 1
            except OSError as exc:
                answers[type(exc).__name__] += 1

    threads = [threading.Thread(target=attacker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return f"{len(body) // 1024} KiB each, 4 clients for {args.bomb_seconds:.0f} s: " + ", ".join(
        f"{k}: {v}" for k, v in answers.most_common())


ATTACKS = {"H2 role (30 MiB)": huge_role, "H2 messages (1M)": many_messages,
           "M3 double Content-Encoding bombs": double_encoding_bombs,
           "H2 11M lists in messages": lists_in("messages"), "H2 11M lists in an unknown field": lists_in("later"),
           "H2 11M lists in logit_bias": lists_in("logit_bias"), "H2 11M lists in messages, 4 sources": lists_from_four}


def figures(watch: Watch) -> tuple[str, str, str]:
    lat = sorted(watch.latencies) or [float("nan")]
    answers = ", ".join(f"{c}: {n}" for c, n in sorted(watch.codes.items()))
    states = ", ".join(f"{s}: {n}" for s, n in watch.states.most_common())
    return answers, f"{statistics.median(lat):.0f} / {lat[-1]:.0f}", states


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a builtin checkpoint (default: a tiny random one)")
    parser.add_argument("--checkout", type=Path, default=HERE, help="the tree whose daemons run (default: this)")
    parser.add_argument("--bomb-seconds", type=float, default=10.0)
    parser.add_argument("--normal-seconds", type=float, default=5.0, help="the legitimate client alone, first")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="hostd-hostile-bench-"))
    checkpoint = args.checkpoint
    if checkpoint is None:
        from hostd.checkpoints.random_model import write_checkpoint

        checkpoint = write_checkpoint(workdir / "tiny")
    checkout = args.checkout.resolve()
    os.chdir(checkout)  # `python -m hostd.main` imports hostd from its working directory first
    os.environ["PYTHONPATH"] = str(checkout)
    port = free_port()
    tree = ModelTree(workdir)
    tree.write_config(checkpoint, fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=4)
    rows = []
    try:
        tree.start_serving(port)
        with Watch(tree) as watch:
            time.sleep(args.normal_seconds)
        rows.append(("no attack", "—", *figures(watch)))
        for name, attack in ATTACKS.items():
            with Watch(tree) as watch:
                time.sleep(1)  # the legitimate client is under way before the attack
                outcome = attack(tree, args)
                time.sleep(1)
            rows.append((name, outcome, *figures(watch)))
            print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        tree.stop_all()

    print(f"\nDaemons from {checkout}; a legitimate client on {LEGIT} sends one small chat (max_tokens 2) "
          "after another, a fresh connection each; the gateway's state asked every 0.2 s\n")
    print("| attack | attacker's answer | legitimate answers | legitimate p50 / max ms | gateway states seen |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
