"""The demo: a model served by hostd under a real systemd, end to end,
with a retained-weight reload.

Run by packaging/demo.sh after the install step. On a host whose PID 1 is
systemd it works on the host itself; anywhere else (a CI VM, a container) it
boots a throwaway systemd 252 in `systemd-nspawn --volatile=yes` (the same
harness as the system tests: tests/system/container.py) and does the same
inside. Every step prints the command an administrator would type.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT / "tests" / "system"))

MODEL = "smollm2"
CHECKPOINTS = "/var/lib/hostd/checkpoints"
CHECKPOINT = f"{CHECKPOINTS}/smollm2-135m-instruct"
# In a throwaway container the converted checkpoint would be lost with it: the
# container's checkpoint directory is this host directory, so the GGUF file is
# converted once per machine (the integration tests share it).
HOST_CACHE = Path(os.environ.get("HOSTD_TEST_CACHE") or "/var/cache/hostd-tests")
QUESTION = "What is the capital of France?"


def free_port(preferred: int) -> int:
    with socket.socket() as s:
        # Probed as systemd's socket unit binds it (SO_REUSEADDR), so a port a
        # caller holds for us without listening (tests/system/ports.py) is usable.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Host:
    """Runs commands on this host (systemd is PID 1) or inside a container."""

    def __init__(self, container=None):
        self.container = container
        self.python = container.python if container else sys.executable

    def run(self, argv: list[str], check: bool = True, timeout: float = 600) -> str:
        print(f"\n$ {shlex.join(argv)}", flush=True)
        if self.container:
            result = self.container.run(argv, check=False, timeout=timeout)
        else:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        output = (result.stdout + result.stderr).rstrip()
        if output:
            print(output, flush=True)
        if check and result.returncode != 0:
            raise SystemExit(f"demo: `{shlex.join(argv)}` exited with {result.returncode}")
        return result.stdout

    def write(self, path: str, text: str) -> None:
        print(f"\n$ cat > {path} <<EOF\n{text}EOF", flush=True)
        if self.container:
            self.container.write_file(path, text)
        else:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)


def demo(host: Host, port: int) -> None:
    # hostd from the checkout's virtual environment; `hostd install` puts
    # hostd and hostctl on root's PATH, and D-Bus activation starts the manager.
    host.run([str(Path(host.python).parent / "hostd"), "install"])
    host.run(["hostd", "convert-gguf", CHECKPOINT], timeout=900)
    host.write(
        f"/etc/hostd/models/{MODEL}.yaml",
        f"backend: builtin\nmodel: {CHECKPOINT}\nlisten: 127.0.0.1:{port}\n"
        "engine:\n  max_num_seqs: 4\n  max_model_len: 2048\n",
    )
    host.run(["hostctl", "config", MODEL])
    host.run(["systemctl", "daemon-reload"])
    started = time.monotonic()
    host.run(["systemctl", "start", f"model@{MODEL}.service"])
    print(f"# systemctl start returned after {time.monotonic() - started:.1f} s: the model serves", flush=True)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    print(f"\n# openai client -> http://127.0.0.1:{port}/v1", flush=True)
    models = [m.id for m in client.models.list()]
    print(f"models: {models}")
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0)
    print(f"chat: {QUESTION!r} -> {answer.choices[0].message.content!r}")
    completion = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=16, temperature=0)
    print(f"completion ({completion.usage.completion_tokens} tokens): {completion.choices[0].text!r}")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a French cheese."}], max_tokens=32,
        temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    print(f"streamed chat: {text!r}", flush=True)

    reload_demo(host, port)

    host.run(["systemctl", "status", "--no-pager", "--lines=0", f"model@{MODEL}.service",
              f"model-engine@{MODEL}.service", f"model-weights@{MODEL}.service"], check=False)
    host.run(["journalctl", f"HOSTD_MODEL={MODEL}", "--no-pager", "-n", "30", "-o", "short"])
    host.run(["systemctl", "stop", f"model@{MODEL}.service"])


def reload_demo(host: Host, port: int) -> None:
    """A retained-weight reload while a client keeps asking: what changed, and
    for how long the model answered 503."""
    weights_pid = host.run(["systemctl", "show", "-p", "MainPID", "--value", f"model-weights@{MODEL}.service"]).strip()
    engine_pid = host.run(["systemctl", "show", "-p", "MainPID", "--value", f"model-engine@{MODEL}.service"]).strip()
    unavailable: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    code = http.get(f"http://127.0.0.1:{port}/v1/models").status_code
                except httpx.HTTPError:
                    code = 0
                if code != 200:
                    unavailable.append(started)
                time.sleep(0.05)

    watcher = threading.Thread(target=poll)
    watcher.start()
    started = time.monotonic()
    host.run(["hostctl", "reload", MODEL, "max_num_seqs=8"])
    took = time.monotonic() - started
    time.sleep(0.5)
    stop.set()
    watcher.join()
    window = (unavailable[-1] - unavailable[0] + 0.05) if unavailable else 0.0
    weights_after = host.run(["systemctl", "show", "-p", "MainPID", "--value", f"model-weights@{MODEL}.service"]).strip()
    engine_after = host.run(["systemctl", "show", "-p", "MainPID", "--value", f"model-engine@{MODEL}.service"]).strip()
    print(
        f"\n# reload: engine.max_num_seqs 4 -> 8 in {took:.1f} s; engine pid {engine_pid} -> {engine_after}; "
        f"weights daemon pid {weights_pid} -> {weights_after} ({'unchanged: weights reused' if weights_pid == weights_after else 'CHANGED'}); "
        f"the model answered 503 + Retry-After for about {window:.2f} s",
        flush=True,
    )
    host.run(["hostctl", "status", MODEL])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="public port (another is picked if busy)")
    args = parser.parse_args()
    port = free_port(args.port)
    if Path("/run/systemd/system").is_dir():
        demo(Host(), port)
        return 0
    from container import SystemdContainer

    print("# systemd is not PID 1 here: booting a throwaway systemd-nspawn --volatile=yes container", flush=True)
    (HOST_CACHE / "checkpoints").mkdir(parents=True, exist_ok=True)
    container = SystemdContainer(checkout=CHECKOUT)
    container.add_bind(HOST_CACHE / "checkpoints", CHECKPOINTS, readonly=False)
    with container:
        # Let the hostd service user reach the bound Python installation (in the container only).
        container.sh("chmod o+x /root")
        demo(Host(container), port)
    print("\n# demo finished; the container is gone", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
