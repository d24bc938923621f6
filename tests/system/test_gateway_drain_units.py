"""The gateway's own SIGTERM drain under a real systemd 252: `systemctl
restart model@NAME` and `systemctl stop model@NAME` with a stream in flight
let that stream run to its last token before the gateway exits
(docs/gateway.md: admitted requests always run to completion).

One container for the module: hostd installed and model tiny, as in
test_model_units.py; no manager is involved. Each test streams through the
public address with the openai client (no retries), issues the systemctl
verb once the first tokens arrived, and asserts what the client got, what
systemd reports and what the stopping gateway wrote to the journal (that it
drained one request in flight, which proves the stream was in flight when
SIGTERM came).
"""

from __future__ import annotations

import threading

import openai
import pytest

from container import SystemdContainer, wait_for
from test_model_units import active, free_port, main_pid, prepare_model, status_code

GATEWAY = "model@tiny.service"
TOKENS = 480  # the tiny checkpoint's 512 positions, less the prompt


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    port = free_port()
    prepare_model(systemd_container, port, timeouts="{start: 120, stop: 120}")
    systemd_container.base_url = f"http://127.0.0.1:{port}"
    return systemd_container


@pytest.fixture
def running(host: SystemdContainer) -> SystemdContainer:
    host.systemctl("start", GATEWAY, timeout=300)
    wait_for(lambda: status_code(host) == 200, timeout=120, what="model serving")
    return host


class Stream(threading.Thread):
    """One streaming completion of TOKENS tokens (ignore_eos), read to its end."""

    def __init__(self, host: SystemdContainer):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.first_tokens = threading.Event()
        self.text, self.finish, self.usage, self.error = "", None, None, None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model="tiny", prompt="x", max_tokens=TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices:
                    self.text += chunk.choices[0].text or ""
                    self.finish = chunk.choices[0].finish_reason or self.finish
                    self.first_tokens.set()
                if chunk.usage:
                    self.usage = chunk.usage.completion_tokens
        except BaseException as exc:  # what the client library raised, for the assertion
            self.error = exc
        finally:
            self.first_tokens.set()


def stream_across(host: SystemdContainer, *verb: str) -> tuple[Stream, int]:
    """Start a stream, run `systemctl --no-block VERB model@tiny` once its
    first tokens arrived, and wait for the stream to end; returns it and the
    PID of the gateway that served it."""
    gateway_pid = main_pid(host, GATEWAY)
    stream = Stream(host)
    stream.start()
    assert stream.first_tokens.wait(120) and stream.error is None, stream.error
    host.systemctl("--no-block", *verb, GATEWAY)
    stream.join(300)  # a safety bound far above the unit's stop timeout, not a speed assertion
    assert not stream.is_alive(), "the stream did not end"
    return stream, gateway_pid


def drained_in_flight(host: SystemdContainer, gateway_pid: int) -> list[str]:
    """What the gateway GATEWAY_PID logged about its stop."""
    return [e["MESSAGE"] for e in host.journal(GATEWAY)
            if e.get("_PID") == str(gateway_pid) and str(e.get("MESSAGE", "")).startswith("stopping")]


def assert_whole(stream: Stream) -> None:
    assert stream.error is None, repr(stream.error)
    assert (stream.finish, stream.usage) == ("length", TOKENS)
    assert stream.text


def test_systemctl_restart_of_the_model_lets_a_stream_in_flight_finish_whole(running):
    host = running
    stream, old_gateway = stream_across(host, "restart")
    assert_whole(stream)
    wait_for(lambda: active(host, GATEWAY) == ["active"] and status_code(host) == 200,
             timeout=300, what="serving again after the restart")
    assert main_pid(host, GATEWAY) != old_gateway  # it was a real restart of the gateway
    lines = wait_for(lambda: drained_in_flight(host, old_gateway), timeout=60, what="the stop's journal line")
    assert lines[0].startswith("stopping: draining 1 in-flight request(s)"), lines
    assert not any("still running" in line for line in drained_in_flight(host, old_gateway))


def test_systemctl_stop_of_the_model_lets_a_stream_in_flight_finish_whole(running):
    host = running
    stream, old_gateway = stream_across(host, "stop")
    assert_whole(stream)
    wait_for(lambda: set(active(host, GATEWAY, "model-engine@tiny.service", "model@tiny.socket")) == {"inactive"},
             timeout=300, what="the model stopped")
    assert status_code(host) == 0  # nothing listens any more
    lines = wait_for(lambda: drained_in_flight(host, old_gateway), timeout=60, what="the stop's journal line")
    assert lines[0].startswith("stopping: draining 1 in-flight request(s)"), lines
    assert not any("still running" in line for line in drained_in_flight(host, old_gateway))
