"""The public front door under a real systemd 252: a model protected by API
keys passed as a systemd credential (LoadCredential= from hostd-generator) is
reloaded with `systemctl reload` while an authorized stream runs; the stream
finishes, the reload is done, the keys keep working and the manager's checks
(which carry no key) never went through the public port. Its metrics
listener (gateway.metrics_listen, bound by the gateway inside the unit's
sandbox) answers curl without a key. docs/gateway.md's nginx block, in front
of it, passes a stream to the openai client."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import yaml

from hostd.config import schema

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_model_units import prepare_model

KEY = "sk-system-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    port = reserved_port()
    container = systemd_container
    container.write_file("/etc/hostd/keys/tiny", f"# keys of model tiny\n{KEY}\n", mode=0o600)
    # The default strategy (in-place): nothing here depends on which one runs.
    metrics_port = reserved_port()
    prepare_model(container, port, timeouts="{start: 120, stop: 60}",
                  gateway=f"{{api_keys: /etc/hostd/keys/tiny, metrics_listen: '127.0.0.1:{metrics_port}'}}")
    container.base_url = f"http://127.0.0.1:{port}"
    container.port = port
    container.metrics_url = f"http://127.0.0.1:{metrics_port}"
    container.systemctl("start", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: httpx.get(container.base_url + "/health", timeout=10).status_code == 200,
             timeout=120, what="serving")
    return container


def test_key_protected_model_reloads_under_an_authorized_stream(host: SystemdContainer):
    unit = host.systemctl("cat", "model@tiny.service").stdout
    assert "LoadCredential=api-keys:/etc/hostd/keys/tiny" in unit
    assert "LimitNOFILE=65536" in unit

    assert httpx.get(host.base_url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(host.base_url + "/v1/models", headers=AUTH, timeout=10).status_code == 200

    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    result: dict = {}
    started = threading.Event()

    def stream() -> None:
        chunks = client.completions.create(model="tiny", prompt="Once", max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        for chunk in chunks:
            started.set()
            if chunk.usage:
                result["tokens"] = chunk.usage.completion_tokens

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    host.write_file("/etc/hostd/models/tiny.d/50-admin.yaml", "engine:\n  max_num_seqs: 2\n")
    host.systemctl("reload", "model@tiny.service", timeout=300)  # blocks until the reload ends; fails if it did
    thread.join(300)
    assert result == {"tokens": 200}  # the admitted stream ran to its end through the reload

    assert httpx.get(host.base_url + "/v1/models", timeout=10).status_code == 401
    answer = client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert answer.choices[0].text is not None

    metrics = httpx.get(host.base_url + "/metrics", headers=AUTH, timeout=10).text
    # the manager's outcome:
    assert 'hostd_gateway_reload_duration_seconds_count{model="tiny",outcome="done"} 1.0' in metrics
    assert 'hostd_gateway_reload_unavailable_seconds_count{model="tiny"} 1.0' in metrics
    assert 'hostd_engine_max_num_seqs{model="tiny"} 2.0' in metrics  # the new engine's own metrics, through the gateway
    assert 'hostd_gateway_refused_total{model="tiny",status="401"} 2.0' in metrics  # the manager never knocked here

    with socket.create_connection(("127.0.0.1", host.port), timeout=10) as conn:
        conn.sendall(b"GET /v1/%2e%2e/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert b"weights_pid" not in answer and b'"state": "serving"' in answer
    host.run(["rm", "-f", "/etc/hostd/models/tiny.d/50-admin.yaml"])


def test_the_metrics_listener_answers_curl_without_a_key_inside_the_units_sandbox(host: SystemdContainer):
    def curl(url: str, *args: str) -> tuple[str, str]:
        out = host.run(["curl", "-s", "-w", "\n%{http_code}", *args, url]).stdout
        body, _, status = out.rpartition("\n")
        return status, body

    status, body = curl(host.metrics_url + "/metrics")
    assert status == "200" and 'hostd_gateway_state{model="tiny",state="serving"} 1.0' in body, (status, body[:300])
    assert 'hostd_engine_max_num_seqs{model="tiny"}' in body  # the engine's own, as on the public page
    assert curl(host.base_url + "/metrics")[0] == "401"  # the public one still wants the key
    status, body = curl(host.metrics_url + "/v1/completions", "-H", "Content-Type: application/json",
                        "-d", '{"model": "tiny", "prompt": "Hi", "max_tokens": 2}')
    assert status == "404" and '"not_found"' in body
    # Loopback TCP needs no opening of the sandbox (a Unix socket's directory would: ReadWritePaths=-DIR).
    assert "ReadWritePaths=-" not in host.systemctl("cat", "model@tiny.service").stdout


def gateway_page_blocks(language: str) -> list[str]:
    """The ```LANGUAGE fenced blocks of docs/gateway.md's reverse-proxy section."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    section = text[text.index("\n## Behind a reverse proxy"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def test_a_stream_through_the_documented_nginx_block_reaches_the_openai_client(host: SystemdContainer):
    """docs/gateway.md's nginx block, as written apart from its two
    addresses, in front of this module's key-protected model: Debian's nginx
    (packaging/setup.sh installs nginx-light; the container sees the host's
    /usr) accepts it (nginx -t), a request without the key gets the
    gateway's 401 through it, and the openai client's stream arrives through
    it as many chunks, to its end with usage. Its YAML block is a valid
    gateway section. (That events are passed on one by one rests on
    proxy_buffering off, which nginx -T shows; no timing is asserted.)"""
    [yaml_block] = gateway_page_blocks("yaml")
    gateway = yaml.safe_load(yaml_block)
    msgspec.convert({"backend": "builtin", "model": "/m", **gateway}, schema.BuiltinModel)  # raises if invalid

    [block] = gateway_page_blocks("nginx")
    assert "server 127.0.0.1:8000;" in block and "listen 8080;" in block
    port = reserved_port()
    block = block.replace("server 127.0.0.1:8000;", f"server 127.0.0.1:{host.port};").replace(
        "listen 8080;", f"listen 127.0.0.1:{port};")
    # The main file a site has around its server blocks, with no include
    # (the container's /etc is its own) and every path in a scratch prefix.
    conf = ("user root;\npid /run/nginx-front/nginx.pid;\nevents {}\nhttp {\n"
            "    access_log off;\n"
            "    client_body_temp_path /run/nginx-front/body;\n    proxy_temp_path /run/nginx-front/proxy;\n"
            "    fastcgi_temp_path /run/nginx-front/fastcgi;\n    uwsgi_temp_path /run/nginx-front/uwsgi;\n"
            "    scgi_temp_path /run/nginx-front/scgi;\n"
            f"{block}}}\n")
    host.run(["mkdir", "-p", "/run/nginx-front"])
    host.write_file("/run/nginx-front/nginx.conf", conf)
    nginx = ["/usr/sbin/nginx", "-e", "stderr", "-p", "/run/nginx-front", "-c", "/run/nginx-front/nginx.conf"]
    checked = host.run([*nginx, "-t"], check=False)
    assert checked.returncode == 0, checked.stderr
    assert "proxy_buffering off;" in host.run([*nginx, "-T"]).stdout
    host.run(["systemd-run", "--unit=nginx-front", *nginx, "-g", "daemon off;"])
    try:
        front = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(front + "/health", timeout=10).status_code == 200, timeout=60,
                 what="nginx in front of the gateway")
        assert httpx.get(front + "/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=front + "/v1", api_key=KEY, max_retries=0, timeout=300)
        chunks = list(client.completions.create(model="tiny", prompt="Once", max_tokens=100, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 100
        assert len([c for c in chunks if c.choices]) > 1
    finally:
        host.run(["systemctl", "stop", "nginx-front.service"], check=False)
