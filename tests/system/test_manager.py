"""The manager (hostd.service, org.hostd1) under a real systemd 252: a reload
through every door keeps the weights, drains without loss, rolls back, refuses
bad patches without touching anything, survives its own SIGKILL and cancels.

One container for the module: hostd installed, model tiny and hostd.service
started. Tests observe what an administrator would: unit PIDs, files, D-Bus
properties via busctl, HTTP answers via the openai client, and the engine's
own metrics (for limits proven by behaviour).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_model_units import greedy, main_pid, prepare_model, stat, status_code

DROPINS = "/etc/hostd/models/tiny.d"


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    port = reserved_port()
    # The default strategy (overlap) on disk; each test runs under the
    # strategies its behaviour must hold for (the `strategy` fixture).
    prepare_model(systemd_container, port, timeouts="{start: 120, stop: 60}")
    systemd_container.base_url = f"http://127.0.0.1:{port}"
    systemd_container.systemctl("start", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: status_code(systemd_container) == 200, timeout=60, what="serving")
    return systemd_container


STRATEGY_DROPIN = f"{DROPINS}/40-strategy.yaml"


def serve_with(host: SystemdContainer, strategy: str) -> SystemdContainer:
    """The model serving, its reloads under STRATEGY (reload.* is read at each
    reload, so a drop-in is all it takes)."""
    host.write_file(STRATEGY_DROPIN, f"reload:\n  strategy: {strategy}\n")
    host.systemctl("start", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: model_state(host) == "serving", timeout=120, what="model serving per the manager")
    host.strategy = strategy
    return host


@pytest.fixture(params=["overlap", "restart"])
def served(request, host: SystemdContainer):
    """Serving, for behaviour that must hold under both strategies."""
    yield serve_with(host, request.param)
    host.run(["rm", "-f", STRATEGY_DROPIN])


@pytest.fixture
def served_restart(host: SystemdContainer):
    """Serving under the restart strategy, for its drain: the tests that use
    it say what of theirs only a drain has (the overlap's counterparts are in
    test_overlap_units.py and test_overlap_units_edges.py)."""
    yield serve_with(host, "restart")
    host.run(["rm", "-f", STRATEGY_DROPIN])


def hostctl(host: SystemdContainer, *args: str, check: bool = False):
    return host.run([host.python, "-m", "hostd.hostctl", *args], check=check, timeout=300)


def busctl(host: SystemdContainer, *args: str, check: bool = True):
    return host.run(["busctl", "--timeout=300", *args], check=check, timeout=320)


def model_state(host: SystemdContainer) -> str:
    result = busctl(host, "get-property", "org.hostd1", "/org/hostd1/model/tiny", "org.hostd1.Model", "State", check=False)
    return result.stdout.split('"')[1] if result.returncode == 0 else ""


def op_property(host: SystemdContainer, path: str, name: str):
    out = busctl(host, "--json=short", "get-property", "org.hostd1", path, "org.hostd1.Operation", name).stdout
    return json.loads(out)["data"]


def last_operation(host: SystemdContainer) -> str:
    out = busctl(host, "--json=short", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "ListOperations").stdout
    rows = json.loads(out)["data"][0]
    return rows[-1][-1]


def wait_operation(host: SystemdContainer, path: str) -> str:
    return wait_for(
        lambda: (s := op_property(host, path, "State")) != "running" and s,
        timeout=300, what=f"operation {path} to end",
    )


def engine_metric(host: SystemdContainer, name: str) -> float:
    text = host.run(["curl", "-s", "--unix-socket", "/run/hostd/tiny/engine.sock", "http://engine/metrics"]).stdout
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in the engine's metrics"
    return float(match.group(1))


def concurrency_allowed(host: SystemdContainer, clients: int) -> int:
    """Run CLIENTS concurrent streams; the engine's high-water mark of running
    requests is the concurrency it actually allowed."""
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def one(_):
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return sum(1 for _ in stream)

    with ThreadPoolExecutor(clients) as pool:
        assert all(n > 0 for n in pool.map(one, range(clients)))
    return int(engine_metric(host, "hostd_engine_requests_running_max"))


def running_max_num_seqs(host: SystemdContainer) -> int:
    health = host.run(["curl", "-s", "--unix-socket", "/run/hostd/tiny/engine.sock", "http://engine/health"]).stdout
    return json.loads(health)["engine_config"]["max_num_seqs"]


def other_values(host: SystemdContainer, count: int = 1) -> list[str]:
    """COUNT values of max_num_seqs the engine does not run now, so a reload
    to them changes something whatever ran before (tests run alone or in any
    order, each strategy after the other)."""
    current = running_max_num_seqs(host)
    return [str(v) for v in (2, 3, 6, 7) if v != current][:count]


def identity(host: SystemdContainer) -> tuple[int, int]:
    return main_pid(host, "model-weights@tiny.service"), stat(host, "/run/hostd/tiny/weights.sock")["inode"]


def kill_manager_and_await_recovery(host: SystemdContainer) -> None:
    """kill -9 of hostd.service mid-reload; returns once systemd started it
    again, its recovery resolved the intent record and the model answers."""
    host.run(["kill", "-9", str(main_pid(host, "hostd.service"))])
    wait_for(lambda: host.systemctl("is-active", "hostd.service", check=False).stdout.strip() == "active",
             timeout=60, what="manager back")
    wait_for(lambda: host.run(["test", "-e", "/var/lib/hostd/.manager/tiny/reload-intent.json"],
                              check=False).returncode == 1, timeout=300, what="intent record resolved")
    wait_for(lambda: status_code(host) == 200, timeout=120, what="serving")


def read_file(host: SystemdContainer, path: str) -> str:
    result = host.run(["cat", path], check=False)
    return result.stdout if result.returncode == 0 else "<absent>"


# Streams that hold a drain open: more than any max_num_seqs these tests run
# (other_values: at most 7), so the engine runs them in rounds and a drain
# lasts several streams' time. Four streams of 480 tokens (about 2 s) were
# once over before a loaded machine's `hostctl reload --no-wait` reached the
# drain (a local run at 4380b3e: "timed out after 30s waiting for draining").
DRAIN_STREAMS = 16


def long_streams(host: SystemdContainer, pool: ThreadPoolExecutor, count: int, admitted: int = 0) -> list:
    """COUNT streams of 480 tokens each (long enough to hold a drain open),
    submitted to POOL; returns their futures (the token count, or -1 for a
    stream the server cut) once the engine runs one of them and the gateway
    has admitted ADMITTED."""
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def one(_):
        # The tokens the engine says it generated (usage), not the chunks: the
        # batched engine may deliver two of a request's tokens in one chunk
        # (a stream once counted 198 chunks beside three of 199 with the
        # same tokens), and a cut stream has no usage.
        tokens = -1
        try:
            for chunk in client.completions.create(
                    model="tiny", prompt="x", max_tokens=480, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        except openai.APIError:
            return -1
        return tokens

    futures = [pool.submit(one, i) for i in range(count)]
    wait_for(lambda: engine_metric(host, "hostd_engine_requests_running") >= 1, timeout=60, what="streams")
    wait_for(lambda: _gateway_status(host)["in_flight"] >= admitted, timeout=60, what=f"{admitted} admitted")
    return futures


# ---------------------------------------------------------------- doors


def test_the_same_reload_succeeds_through_every_door(served):
    host = served
    weights, output = identity(host), greedy(host)

    def after(limit: int, op_path: str) -> None:
        assert op_property(host, op_path, "State") == "done"
        assert op_property(host, op_path, "WeightsReused") is True
        assert concurrency_allowed(host, 2 * limit) == limit  # the new limit, by behaviour
        assert identity(host) == weights
        assert greedy(host) == output

    # Whatever an earlier reload left in 90-reload.yaml would win over 50-admin.yaml.
    host.run(["rm", "-f", f"{DROPINS}/90-reload.yaml"])
    # 1. A drop-in edited by hand, then `systemctl reload` (the config on disk).
    host.write_file(f"{DROPINS}/50-admin.yaml", "engine:\n  max_num_seqs: 2\n")
    host.systemctl("reload", "model@tiny.service", timeout=300)
    after(2, last_operation(host))

    # 2. busctl, with a typed a{sv} patch.
    out = busctl(host, "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload",
                 "sa{sv}", "tiny", "1", "max_num_seqs", "u", "3").stdout
    path = out.split('"')[1]
    wait_operation(host, path)
    after(3, path)

    # 3. hostctl, which waits and shows the stages.
    result = hostctl(host, "reload", "tiny", "max_num_seqs=4")
    assert result.returncode == 0, result.stderr
    assert model_state(host) == "serving"  # at once: the manager follows its units' signals
    assert f"reload of tiny: done (strategy {host.strategy}, weights reused)" in result.stdout
    first = {"restart": "drain", "overlap": "start-next"}[host.strategy]
    assert f": {first} (" in result.stderr and ": finished (" in result.stderr  # live progress, elapsed times
    after(4, last_operation(host))

    # 4. The Python client (run where the system bus is: inside the container).
    script = (
        "from hostd.client import Client\n"
        "with Client() as hostd:\n"
        "    r = hostd.reload('tiny', {'max_num_seqs': 5})\n"
        "print(r['State'], r['WeightsReused'], r['path'])\n"
    )
    state, reused, path = host.run([host.python, "-c", script], timeout=300).stdout.split()
    assert (state, reused) == ("done", "True")
    after(5, path)
    assert "max_num_seqs: 5" in read_file(host, f"{DROPINS}/90-reload.yaml")
    host.run(["rm", "-f", f"{DROPINS}/50-admin.yaml"])


def test_a_reload_drains_16_streams_and_loses_none(served_restart):
    # restart only: it needs 503s while it drains.
    served = served_restart
    host = served
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    hostctl(host, "reload", "tiny", "max_num_seqs=16", check=True)

    def stream(_):
        # 480 tokens, most of the tiny model's 512 positions: a batch of 16
        # makes a token every ~5 ms here (benchmarks/engine_step.py), so the
        # 64 this test once asked for (0.3 s) were over before the 16th
        # stream was admitted on a loaded CI machine (stop 63).
        usage = None
        for chunk in client.completions.create(
                model="tiny", prompt="Tell me a story", max_tokens=480, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage, time.monotonic()

    refused: list[httpx.Response] = []
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(stream, i) for i in range(16)]
        # The engine's high-water mark, which a poll cannot miss between two reads.
        wait_for(lambda: engine_metric(host, "hostd_engine_requests_running_max") >= 16, timeout=60,
                 what="16 streaming at once")
        asked = time.monotonic()
        out = busctl(host, "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload",
                     "sa{sv}", "tiny", "1", "max_num_seqs", "u", "8").stdout
        path = out.split('"')[1]
        while op_property(host, path, "State") == "running" and len(refused) < 20:
            response = httpx.post(host.base_url + "/v1/completions",
                                  json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60)
            if response.status_code == 503:
                refused.append(response)
            time.sleep(0.2)
        wait_operation(host, path)
        results = [s.result(300) for s in streams]

    assert [tokens for tokens, _ in results] == [480] * 16  # every admitted stream finished, in full
    assert all(ended > asked for _, ended in results), "a stream ended before the reload was asked: nothing drained it"
    assert refused, "no request arrived while the model was unavailable"
    assert all(r.headers["Retry-After"] and r.json()["error"]["type"] == "service_unavailable" for r in refused)
    assert op_property(host, path, "State") == "done"
    assert status_code(host) == 200


def test_a_reload_the_engine_cannot_start_with_rolls_back(served):
    host = served
    before = read_file(host, f"{DROPINS}/90-reload.yaml")
    weights, output = identity(host), greedy(host)

    result = hostctl(host, "reload", "tiny", "max_model_len=99999")

    assert result.returncode == 1
    path = last_operation(host)
    assert op_property(host, path, "State") == "rolled-back"
    assert op_property(host, path, "Restored") is True
    assert "max_position_embeddings" in op_property(host, path, "Error")  # the engine's own words
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == before  # the drop-in is rewritten
    wait_for(lambda: status_code(host) == 200, timeout=60, what="old config serving")
    assert identity(host) == weights and greedy(host) == output

    # The same through `systemctl reload` after an administrator's own edit:
    # it fails, and the previous values are pinned above the admin's file.
    host.write_file(f"{DROPINS}/95-override.yaml", "engine:\n  max_model_len: 99999\n")
    failed = host.systemctl("reload", "model@tiny.service", check=False, timeout=300)
    assert failed.returncode != 0
    assert "max_model_len" in read_file(host, f"{DROPINS}/99-rollback.yaml")
    assert "pinned" in " ".join(op_property(host, last_operation(host), "Notes"))
    host.run(["rm", "-f", f"{DROPINS}/95-override.yaml", f"{DROPINS}/99-rollback.yaml"])
    wait_for(lambda: status_code(host) == 200, timeout=60, what="serving")


FORGE = r"""
# hostctl's bus name: of the processes running it (a wrapper's command line
# may name it too), the one with a connection on the bus. /proc and sh, as
# the container has them (no procps, no awk); [h]: not this script's own command line.
names=$(busctl list --no-legend --unique)
name=
for f in /proc/[0-9]*/cmdline; do
    tr '\0' ' ' < "$f" 2>/dev/null | grep -q '[h]ostd[.]hostctl reload tiny max_model_len' || continue
    p=${f#/proc/}; p=${p%/cmdline}
    name=$(printf '%s\n' "$names" | while read -r n pid rest; do [ "$pid" = "$p" ] && echo "$n"; done | head -n 1)
    [ -n "$name" ] && break
done
[ -n "$name" ] || exit 4
as_nobody="setpriv --reuid=65534 --regid=65534 --clear-groups"
$as_nobody busctl emit --destination="$name" /org/hostd1 org.hostd1.Manager OperationFinished uoss "$1" "$2" tiny done
$as_nobody busctl emit --destination="$name" "$2" org.freedesktop.DBus.Properties PropertiesChanged \
    'sa{sv}as' org.hostd1.Operation 2 State s done Stage s done 0
"""


def test_a_forged_end_from_another_user_does_not_end_hostctl_reload(served_restart):
    """Issue 52, S2 (acceptance 3), on the system bus with hostd's policy: while
    `hostctl reload` waits for a reload that will roll back (under the restart
    strategy, its drain held by a stream), uid 65534 sends
    it `OperationFinished ... done` and the operation's `PropertiesChanged
    State=done`, addressed to its unique name (the bus delivers such a
    signal whatever the match rules say). hostctl still reports the rollback
    and exits 1: it follows only the owner of org.hostd1."""
    host = served_restart
    rows = json.loads(busctl(host, "--json=short", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager",
                             "ListOperations").stdout)["data"][0]
    op_id = max((row[0] for row in rows), default=0) + 1
    path = f"/org/hostd1/operation/{op_id}"
    forged = 0
    with ThreadPoolExecutor(2) as pool:
        # A stream holds the restart strategy's drain for seconds: the forger's window.
        streams = long_streams(host, pool, 1)
        reload = pool.submit(hostctl, host, "reload", "tiny", "max_model_len=99999")
        while not reload.done():
            sent = host.run(["sh", "-c", FORGE, "forge", str(op_id), path], check=False)
            assert sent.returncode in (0, 4), sent.stderr  # 4: hostctl not started or not on the bus yet
            forged += sent.returncode == 0
            assert not reload.done() or op_property(host, path, "State") != "running"
        result = reload.result()
        assert [f.result() for f in streams] == [480]  # the drain let it finish
    assert forged >= 1, "no forged signal was sent while hostctl waited"
    assert result.returncode == 1, result.stdout + result.stderr
    assert last_operation(host) == path and op_property(host, path, "State") == "rolled-back"
    wait_for(lambda: status_code(host) == 200, timeout=60, what="old config serving")


@pytest.mark.parametrize(
    "patch_args, error",
    [
        (("dtype", "s", "float32"), "org.hostd1.Error.NotEditable"),
        (("bogus", "u", "1"), "org.hostd1.Error.NotEditable"),
        (("max_num_seqs", "s", "16"), "org.hostd1.Error.InvalidValue"),
        (("max_num_seqs", "u", "0"), "org.hostd1.Error.InvalidValue"),
    ],
    ids=["fixed-field", "unknown-field", "wrong-dbus-type", "out-of-range"],
)
def test_bad_patches_are_refused_and_change_nothing(served, patch_args, error):
    host = served
    engine_pid = main_pid(host, "model-engine@tiny.service")
    dropin = read_file(host, f"{DROPINS}/90-reload.yaml")
    drains = _gateway_drains(host)

    result = busctl(host, "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload",
                    "sa{sv}", "tiny", "1", *patch_args, check=False)

    assert result.returncode != 0
    assert error in _error_name(host, patch_args), result.stderr
    assert main_pid(host, "model-engine@tiny.service") == engine_pid  # no restart
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin  # no file written
    assert _gateway_drains(host) == drains  # no drain


def _gateway_drains(host: SystemdContainer) -> int:
    return _gateway_status(host)["drains"]


def _gateway_status(host: SystemdContainer) -> dict:
    script = ("import msgspec; from hostd.gateway import control; from pathlib import Path; "
              "print(msgspec.json.encode(control.call(Path('/run/hostd/tiny/control.sock'), control.Status())).decode())")
    return json.loads(host.run([host.python, "-c", script]).stdout)


def _error_name(host: SystemdContainer, patch_args) -> str:
    """The D-Bus error name of the refusal, as a client library sees it."""
    key, _sig, value = patch_args
    typed = {"s": repr(value), "u": value}[_sig]
    script = (
        "import asyncio\n"
        "from dbus_fast import BusType, Variant\nfrom dbus_fast.aio import MessageBus\n"
        "from dbus_fast.errors import DBusError\n"
        "async def main():\n"
        "    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()\n"
        "    i = await bus.introspect('org.hostd1', '/org/hostd1')\n"
        "    m = bus.get_proxy_object('org.hostd1', '/org/hostd1', i).get_interface('org.hostd1.Manager')\n"
        "    try:\n"
        f"        await m.call_reload('tiny', {{{key!r}: Variant({_sig!r}, {typed})}})\n"
        "    except DBusError as e:\n"
        "        print(e.type, e.text)\n"
        "asyncio.run(main())\n"
    )
    return host.run([host.python, "-c", script], timeout=60).stdout


def test_second_reload_is_busy_and_non_admin_is_denied(served):
    host = served
    one, two = other_values(host, 2)
    first = hostctl(host, "reload", "tiny", f"max_num_seqs={one}", "--no-wait", check=True).stdout.strip()
    second = busctl(host, "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload",
                    "sa{sv}", "tiny", "1", "max_num_seqs", "u", two, check=False)
    assert second.returncode != 0 and "busy" in second.stderr.lower()
    wait_operation(host, first)

    denied = host.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                       "busctl", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload",
                       "sa{sv}", "tiny", "1", "max_num_seqs", "u", "7"], check=False)
    assert denied.returncode != 0 and "denied" in denied.stderr.lower(), denied.stderr
    # Reading stays open to everyone.
    listed = host.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                       "busctl", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "ListModels"])
    assert '"tiny"' in listed.stdout


HOSTILE = "/srv/hostile"  # a checkpoint directory any user could have made


def test_a_checkpoint_config_json_that_is_a_fifo_a_sparse_file_or_renamed_mid_read_never_holds_the_manager(
        served_restart):
    """Issue 52, S1 (acceptance 2), on the real manager: a drop-in names a
    checkpoint whose config.json is a FIFO with no writer, then a sparse
    400 MiB file, then a FIFO and a regular file renamed over each other while
    the checks run. `hostctl reload --check` as nobody (the review's door)
    and CheckReload of a swap as root are answered, each naming config.json;
    `hostctl list` answers between them; the manager keeps its PID, was
    not restarted and stays under its MemoryMax=. The seconds are printed,
    not asserted (they are the benchmark's business)."""
    host = served_restart  # for a serving model; no reload runs here, so the strategy plays no part
    pid = main_pid(host, "hostd.service")
    host.sh(f"rm -rf {HOSTILE} && cp -r /var/lib/hostd/checkpoints/tiny {HOSTILE} && rm {HOSTILE}/config.json"
            f" && mkfifo {HOSTILE}/config.json && chmod -R a+rX {HOSTILE}")
    host.write_file(f"{DROPINS}/50-hostile.yaml", f"model: {HOSTILE}\n")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    swap_check = ["busctl", "--timeout=60", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager",
                  "CheckReload", "sa{sv}", "tiny", "1", "model", "s", HOSTILE]
    timings = {}

    def answered(name: str, args: list[str]) -> str:
        started = time.monotonic()
        result = host.run(args, check=False, timeout=60)  # a manager held by the file would time this out
        timings[name] = round(time.monotonic() - started, 2)
        assert "Timeout" not in result.stderr and "timed out" not in result.stderr, result.stderr
        return result.stdout + result.stderr

    def listed() -> None:
        assert '"tiny"' in answered(f"list {len(timings)}", ["busctl", "--timeout=60", "call", "org.hostd1",
                                                              "/org/hostd1", "org.hostd1.Manager", "ListModels"])

    try:
        fifo = answered("fifo: hostctl reload --check as nobody",
                        nobody + [host.python, "-m", "hostd.hostctl", "reload", "tiny", "max_num_seqs=3", "--check"])
        assert "config.json" in fifo, fifo
        assert "config.json" in answered("fifo: CheckReload model= as root", swap_check)
        listed()

        host.sh(f"rm {HOSTILE}/config.json && truncate -s 400M {HOSTILE}/config.json")
        answered("sparse: hostctl reload --check as nobody",  # refused or not, answered
                 nobody + [host.python, "-m", "hostd.hostctl", "reload", "tiny", "max_num_seqs=3", "--check"])
        sparse = answered("sparse: CheckReload model= as root", swap_check)
        assert "config.json" in sparse and "larger than" in sparse, sparse
        listed()

        # A FIFO and a regular file renamed over config.json, over and over, while 20 checks run.
        host.run(["sh", "-c", f"cd {HOSTILE} && (while :; do mkfifo f.tmp; mv f.tmp config.json; "
                              "echo {} > r.tmp; mv r.tmp config.json; done) >/dev/null 2>&1 & echo $! > /run/racer"])
        for i in range(20):
            answered(f"racing {i}", swap_check)
        listed()
    finally:
        host.sh("kill $(cat /run/racer) 2>/dev/null; rm -f /run/racer", check=False)
        host.run(["rm", "-f", f"{DROPINS}/50-hostile.yaml"])
        host.run(["rm", "-rf", HOSTILE])
    print("seconds per call:", json.dumps(timings))
    shown = host.systemctl("show", "-p", "MainPID", "-p", "NRestarts", "-p", "MemoryMax", "hostd.service").stdout
    facts = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    assert int(facts["MainPID"]) == pid and facts["NRestarts"] == "0", facts
    # The manager's peak resident memory (the container keeps no cgroup memory
    # accounting for it: MemoryCurrent is [not set]) under its MemoryMax=.
    peak = host.run(["grep", "VmHWM", f"/proc/{pid}/status"]).stdout.split()[1]
    print(f"manager peak RSS {int(peak) >> 10} MiB of MemoryMax={int(facts['MemoryMax']) >> 20} MiB")
    assert int(peak) * 1024 < int(facts["MemoryMax"]), (peak, facts)
    assert model_state(host) == "serving"


def test_manager_killed_mid_reload_ends_consistent_and_serving(served):
    host = served
    [value] = other_values(host)
    path = hostctl(host, "reload", "tiny", f"max_num_seqs={value}", "--no-wait", check=True).stdout.strip()
    wait_for(lambda: op_property(host, path, "Stage") in ("restart", "verify"), timeout=60, what="engine restart")
    host.run(["kill", "-9", str(main_pid(host, "hostd.service"))])

    # systemd restarts the manager; its recovery commits or rolls back.
    wait_for(lambda: host.systemctl("is-active", "hostd.service", check=False).stdout.strip() == "active",
             timeout=60, what="manager back")
    wait_for(lambda: host.run(["test", "-e", "/var/lib/hostd/.manager/tiny/reload-intent.json"], check=False).returncode == 1,
             timeout=300, what="intent record resolved")
    wait_for(lambda: status_code(host) == 200, timeout=120, what="serving")
    running = json.loads(host.run(["curl", "-s", "--unix-socket", "/run/hostd/tiny/engine.sock",
                                   "http://engine/health"]).stdout)["engine_config"]
    on_disk = json.loads(hostctl(host, "config", "tiny", "--json", check=True).stdout)["data"]
    assert running["max_num_seqs"] == on_disk["engine.max_num_seqs"]["value"]  # consistent either way
    assert "recovery:" in host.run(["journalctl", "-u", "hostd.service", "-o", "cat", "--no-pager"]).stdout


def test_manager_killed_during_a_drain_leaves_the_engine_alone_and_loses_no_stream(served_restart):
    # restart only: it needs a drain to be killed in.
    served = served_restart
    host = served
    engine_pid = main_pid(host, "model-engine@tiny.service")
    dropin = read_file(host, f"{DROPINS}/90-reload.yaml")

    with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        streaming = long_streams(host, pool, DRAIN_STREAMS, admitted=DRAIN_STREAMS)
        [value] = other_values(host)
        path = hostctl(host, "reload", "tiny", f"max_num_seqs={value}", "--no-wait", check=True).stdout.strip()
        wait_for(lambda: op_property(host, path, "Stage") == "drain", timeout=30, what="draining")
        host.run(["kill", "-9", str(main_pid(host, "hostd.service"))])

        # systemd restarts the manager; recovery finds the old engine still
        # running the config from before the reload: it restores the drop-in,
        # resumes the gateway and leaves the engine (and its streams) alone.
        wait_for(lambda: host.run(["test", "-e", "/var/lib/hostd/.manager/tiny/reload-intent.json"],
                                  check=False).returncode == 1, timeout=120, what="intent record resolved")
        wait_for(lambda: status_code(host) == 200, timeout=60, what="serving again")
        tokens = [s.result(300) for s in streaming]
        assert -1 not in tokens and len(set(tokens)) == 1 and tokens[0] > 0, tokens  # every stream, in full

    assert main_pid(host, "model-engine@tiny.service") == engine_pid  # never restarted
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin
    journal = host.run(["journalctl", "-u", "hostd.service", "-o", "cat", "--no-pager"]).stdout
    assert "engine left alone" in journal


def test_cancel_during_drain_restores_and_resumes_without_restart(served_restart):
    # restart only: it needs a drain to cancel.
    served = served_restart
    host = served
    engine_pid = main_pid(host, "model-engine@tiny.service")
    dropin = read_file(host, f"{DROPINS}/90-reload.yaml")

    # Long streams, queued beyond max_num_seqs, keep the drain waiting long enough to cancel it.
    with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        streaming = long_streams(host, pool, DRAIN_STREAMS)
        [value] = other_values(host)
        path = hostctl(host, "reload", "tiny", f"max_num_seqs={value}", "--no-wait", check=True).stdout.strip()
        wait_for(lambda: op_property(host, path, "Stage") == "drain", timeout=30, what="draining")
        op_id = str(op_property(host, path, "Id"))
        assert hostctl(host, "cancel", op_id).returncode == 0
        assert wait_operation(host, path) == "cancelled"
        assert all(s.result(300) > 0 for s in streaming)

    assert op_property(host, path, "Restored") is True
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin
    assert main_pid(host, "model-engine@tiny.service") == engine_pid
    wait_for(lambda: status_code(host) == 200, timeout=30, what="serving again")


def invocation(host: SystemdContainer, unit: str) -> dict[str, str]:
    """UNIT's InvocationID, NRestarts and MainPID: a new start changes the first."""
    out = host.systemctl("show", "-p", "InvocationID", "-p", "NRestarts", "-p", "MainPID", unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_stopping_the_model_interrupts_a_reload_and_restores_its_dropin(served_restart):
    # restart only: it needs a drain to interrupt.
    served = served_restart
    host = served
    dropin = read_file(host, f"{DROPINS}/90-reload.yaml")
    everything = ("model@tiny.service", "model-engine@tiny.service", "model-weights@tiny.service")
    before = {unit: invocation(host, unit) for unit in everything}

    with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        long_streams(host, pool, DRAIN_STREAMS)  # cut off by the stop: expected here
        [value] = other_values(host)
        path = hostctl(host, "reload", "tiny", f"max_num_seqs={value}", "--no-wait", check=True).stdout.strip()
        wait_for(lambda: op_property(host, path, "Stage") == "drain", timeout=30, what="draining")
        stop = hostctl(host, "stop", "tiny")
        assert stop.returncode == 0, stop.stdout + stop.stderr

    assert wait_operation(host, path) == "failed"
    assert "interrupted" in op_property(host, path, "Error")
    assert op_property(host, path, "Restored") is True
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin
    wait_for(lambda: set(host.systemctl("is-active", *everything, check=False).stdout.split()) == {"inactive"},
             timeout=120, what="everything stopped")
    # Nothing started again after the stop: each unit's last invocation is
    # still the one that ran before it (a start, or a restart by the
    # interrupted reload, would show a new InvocationID), it has no main
    # process, and systemd restarted none of them on its own.
    for unit in everything:
        after = invocation(host, unit)
        assert after["MainPID"] == "0" and after["NRestarts"] == before[unit]["NRestarts"], (unit, after)
        assert after["InvocationID"] in (before[unit]["InvocationID"], ""), (unit, before[unit], after)
