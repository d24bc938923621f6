"""The config loader: merge order, origins, and every kind of error, each of
which must name the file and the key path and leave nothing changed."""

from __future__ import annotations

import os
import stat
import string
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostd import config, host_check, paths
from hostd.config import load, schema, show
from hostd.config.atomic import write_atomic


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write(
        tmp_path,
        "models/tiny.yaml",
        """\
        backend: builtin
        model: /srv/models/tiny
        gpus: [0, 1]
        engine:
          max_num_seqs: 4
          max_model_len: 256
        """,
    )
    return tmp_path


def problems_of(root: Path, name: str = "tiny") -> list[config.Problem]:
    with pytest.raises(config.ConfigError) as info:
        config.load_model(name, root)
    return info.value.problems


# ---------------------------------------------------------------- merging


def test_dropins_merge_deeply_in_lexical_order_over_defaults(root: Path):
    write(root, "hostd.yaml", "defaults:\n  listen: '9000'\n  engine: {shutdown_timeout: 5}\n")
    write(root, "models/tiny.d/20-b.yaml", "engine: {max_num_seqs: 8}\n")
    write(root, "models/tiny.d/10-a.yaml", "engine: {max_num_seqs: 6, max_model_len: 64}\n")
    write(root, "models/tiny.d/30-c.yaml", "gpus: [3]\n")

    loaded = config.load_model("tiny", root)

    engine = loaded.config.engine
    assert engine.max_num_seqs == 8  # 20-b wins over 10-a, which won over tiny.yaml
    assert engine.max_model_len == 64  # 10-a's value survives 20-b (deep merge)
    assert engine.shutdown_timeout == 5  # from hostd.yaml defaults, beneath all
    assert loaded.config.listen == "127.0.0.1:9000"  # a bare port is loopback's
    assert loaded.config.gpus == [3]  # lists are replaced, not appended
    assert loaded.merged.files == [
        str(root / "hostd.yaml"),
        str(root / "models/tiny.yaml"),
        str(root / "models/tiny.d/10-a.yaml"),
        str(root / "models/tiny.d/20-b.yaml"),
        str(root / "models/tiny.d/30-c.yaml"),
    ]


def test_every_value_keeps_the_file_it_came_from(root: Path):
    write(root, "hostd.yaml", "defaults:\n  reload: {drain_timeout: 7}\n")
    write(root, "models/tiny.d/50-x.yaml", "engine: {max_num_seqs: 2}\n")

    origins = show.with_origins(config.load_model("tiny", root))

    assert origins["engine.max_num_seqs"] == {"value": 2, "origin": str(root / "models/tiny.d/50-x.yaml")}
    assert origins["engine.max_model_len"]["origin"] == str(root / "models/tiny.yaml")
    assert origins["reload.drain_timeout"] == {"value": 7.0, "origin": str(root / "hostd.yaml")}
    assert origins["gateway.retry_after"] == {"value": 5, "origin": "(default)"}
    assert origins["gpus"]["origin"] == str(root / "models/tiny.yaml")


def test_a_mapping_replaced_by_a_scalar_forgets_the_old_origins(root: Path):
    write(root, "models/tiny.d/10.yaml", "env: {A: '1'}\n")
    write(root, "models/tiny.d/20.yaml", "env: {}\n")
    loaded = config.load_model("tiny", root)
    assert loaded.config.env == {"A": "1"}  # {} merges into a mapping: nothing changes
    write(root, "models/tiny.d/20.yaml", "env: null\n")
    problems = problems_of(root)
    assert [(p.key, p.file) for p in problems] == [("env", str(root / "models/tiny.d/20.yaml"))]


def test_each_backend_has_its_own_editable_fields():
    assert schema.editable_fields("builtin") == (
        "max_num_seqs", "max_model_len", "batching", "kv_cache_mib", "shutdown_timeout", "enforce_eager")
    assert "gpu_memory_utilization" in schema.editable_fields("vllm")
    assert "mem_fraction_static" in schema.editable_fields("sglang")
    assert "max_num_seqs" not in schema.editable_fields("sglang")


def test_upstream_backends_load_with_their_own_names(tmp_path: Path):
    write(tmp_path, "models/v.yaml", "backend: vllm\nmodel: /m\nengine: {gpu_memory_utilization: 0.5}\n")
    write(tmp_path, "models/s.yaml", "backend: sglang\nmodel: /m\nengine: {chunked_prefill_size: -1}\n")
    assert config.load_model("v", tmp_path).config.engine.gpu_memory_utilization == 0.5
    assert config.load_model("s", tmp_path).config.engine.chunked_prefill_size == -1
    write(tmp_path, "models/s.yaml", "backend: sglang\nmodel: /m\nengine: {max_num_seqs: 3}\n")
    [problem] = problems_of(tmp_path, "s")
    assert (problem.key, problem.message) == ("engine.max_num_seqs", "unknown key")


# ---------------------------------------------------------------- errors


def test_malformed_yaml_names_file_and_line(root: Path):
    bad = write(root, "models/tiny.d/10-bad.yaml", "engine:\n  max_num_seqs: [1, 2\n")
    [problem] = problems_of(root)
    assert problem.file == str(bad)
    assert problem.line == 3
    assert "malformed YAML" in problem.message
    assert str(problem).startswith(f"{bad}:3:")


def test_unknown_key_names_file_and_key_path(root: Path):
    bad = write(root, "models/tiny.d/10.yaml", "engine:\n  max_num_sqes: 4\n")
    [problem] = problems_of(root)
    assert (problem.file, problem.line, problem.key, problem.message) == (
        str(bad), 2, "engine.max_num_sqes", "unknown key")


def test_wrong_type_names_file_key_and_expected_type(root: Path):
    bad = write(root, "models/tiny.d/10.yaml", "gateway:\n  retry_after: soon\n")
    [problem] = problems_of(root)
    assert (problem.file, problem.key) == (str(bad), "gateway.retry_after")
    assert "expected `int`, got `str`" in problem.message


@pytest.mark.parametrize(
    "text, key, expected",
    [
        ("engine: {max_num_seqs: 0}", "engine.max_num_seqs", ">= 1"),
        ("engine: {max_num_seqs: 100000}", "engine.max_num_seqs", "<= 4096"),
        ("reload: {drain_timeout: -1}", "reload.drain_timeout", "> 0"),
        ("reload: {standby_kv_mib: 0}", "reload.standby_kv_mib", ">= 1"),
        ("reload: {standby_kv_mib: 2097152}", "reload.standby_kv_mib", "<= 1048576"),
        ("listen: '99999'", "listen", "no port from 1 to 65535"),
        ("gpus: [-1]", "gpus.0", ">= 0"),
        ("model: relative/path", "model", "not an absolute path"),
    ],
)
def test_out_of_range_value_names_file_key_and_range(root: Path, text, key, expected):
    bad = write(root, "models/tiny.d/10.yaml", text + "\n")
    [problem] = problems_of(root)
    assert (problem.file, problem.key) == (str(bad), key)
    assert expected in problem.message


@pytest.mark.parametrize("address", ["127.0.0.1:9101", "[::1]:9101", "/run/hostd-metrics/tiny.sock"])
def test_the_metrics_listener_takes_a_loopback_address_or_a_unix_socket(root: Path, address):
    write(root, "models/tiny.d/10.yaml", f"gateway: {{metrics_listen: '{address}'}}\n")
    assert config.load_model("tiny", root).config.gateway.metrics_listen == address


@pytest.mark.parametrize(
    "address, expected",
    [
        ("0.0.0.0:9101", "is not a loopback address: without gateway.metrics_token the metrics listener checks no key"),
        ("[::]:9101", "is not a loopback address"),
        ("192.168.1.5:9101", "is not a loopback address"),
        ("localhost:9101", "is not a loopback address"),
        ("9101", "is not a loopback address"),  # a bare port listens on every address
        ("127.0.0.1:0", "has no port from 1 to 65535; use '127.0.0.1:PORT' or '[::1]:PORT'"),
        ("/" + "x" * 120, "is longer than"),
    ],
)
def test_a_metrics_listener_anyone_could_reach_is_refused_naming_the_key(root: Path, address, expected):
    bad = write(root, "models/tiny.d/10.yaml", f"gateway: {{metrics_listen: '{address}'}}\n")
    [problem] = problems_of(root)
    assert (problem.file, problem.key) == (str(bad), "gateway.metrics_listen")
    assert expected in problem.message


@pytest.mark.parametrize("address", ["0.0.0.0:9101", "[::]:9101", "10.0.0.5:9101", "[fd00::5]:9101", "127.0.0.1:9101"])
def test_with_a_metrics_token_the_listener_takes_any_ip_address_of_the_host(root: Path, address):
    write(root, "models/tiny.d/10.yaml",
          f"gateway: {{metrics_listen: '{address}', metrics_token: /etc/hostd/keys/tiny-metrics}}\n")
    gateway = config.load_model("tiny", root).config.gateway
    assert (gateway.metrics_listen, gateway.metrics_token) == (address, "/etc/hostd/keys/tiny-metrics")


@pytest.mark.parametrize(
    "gateway, key, expected",
    [
        ("{metrics_listen: 'metrics.example:9101', metrics_token: /k}", "gateway.metrics_listen",
         "the host must be an IP address"),
        ("{metrics_listen: '9101', metrics_token: /k}", "gateway.metrics_listen", "the host must be an IP address"),
        ("{metrics_listen: '::1:9101', metrics_token: /k}", "gateway.metrics_listen", "the host must be an IP address"),
        ("{metrics_listen: '0.0.0.0:0', metrics_token: /k}", "gateway.metrics_listen", "has no port from 1 to 65535"),
        ("{metrics_listen: '0.0.0.0:9101', metrics_token: k}", "gateway.metrics_token", "is not an absolute path"),
        ("{metrics_token: /k}", "gateway.metrics_token", "guards metrics_listen, which is not set"),
    ],
)
def test_a_metrics_token_needs_a_listener_an_absolute_path_and_an_ip_address(root: Path, gateway, key, expected):
    bad = write(root, "models/tiny.d/10.yaml", f"gateway: {gateway}\n")
    # The loader goes on without the refused key: the other one then says what it lacks too.
    problem = problems_of(root)[0]
    assert (problem.file, problem.key) == (str(bad), key)
    assert expected in problem.message


def test_a_metrics_listener_on_the_public_port_is_refused(root: Path):
    write(root, "models/tiny.d/10.yaml", "listen: '8000'\ngateway: {metrics_listen: '127.0.0.1:8000'}\n")
    [problem] = problems_of(root)
    assert problem.key == "gateway" and "metrics_listen '127.0.0.1:8000' has the port of listen:" in problem.message


def test_sglang_chunked_prefill_size_zero_is_refused(tmp_path: Path):
    write(tmp_path, "models/s.yaml", "backend: sglang\nmodel: /m\nengine: {chunked_prefill_size: 0}\n")
    [problem] = problems_of(tmp_path, "s")
    assert problem.key == "engine.chunked_prefill_size"
    assert "-1 (no chunking) or at least 1" in problem.message


def test_missing_and_unknown_backend(tmp_path: Path):
    write(tmp_path, "models/a.yaml", "model: /m\n")
    write(tmp_path, "models/b.yaml", "backend: tgi\nmodel: /m\n")
    [missing] = problems_of(tmp_path, "a")
    [unknown] = problems_of(tmp_path, "b")
    assert (missing.key, missing.file) == ("backend", str(tmp_path / "models/a.yaml"))
    assert "required key is missing" in missing.message
    assert (unknown.key, unknown.line) == ("backend", 1)
    assert "unknown backend 'tgi'" in unknown.message


@pytest.mark.parametrize("name", ["../etc", "a b", "-x", ".hidden", "x@y", "", "é"])
def test_bad_model_name_is_refused(tmp_path: Path, name):
    [problem] = problems_of(tmp_path, name)
    assert "is not allowed" in problem.message
    assert problem.file.endswith(f"{name}.yaml")


def test_too_long_model_name_is_refused_and_the_longest_allowed_fits_every_socket(tmp_path: Path):
    longest = "m" * paths.max_model_name_length()
    assert schema.model_name_problem(longest) is None
    for socket in (paths.weights_socket, paths.engine_socket, paths.control_socket):
        assert len(str(socket(longest)).encode()) <= paths.SUN_PATH_MAX
    upstream = paths.RUNTIME_ROOT / longest / paths._LONGEST_UPSTREAM_SOCKET
    assert len(str(upstream).encode()) <= paths.SUN_PATH_MAX
    [problem] = problems_of(tmp_path, longest + "m")
    assert "characters long" in problem.message


def test_dropin_directory_with_a_non_yaml_file_is_an_error(root: Path):
    stray = write(root, "models/tiny.d/10-limits.yml", "engine: {max_num_seqs: 1}\n")
    write(root, "models/tiny.d/.10-limits.yaml.swp", "binary junk")  # hidden: skipped
    [problem] = problems_of(root)
    assert problem.file == str(stray)
    assert "not a *.yaml file" in problem.message


def test_duplicate_key_is_an_error(root: Path):
    bad = write(root, "models/tiny.d/10.yaml", "engine:\n  max_num_seqs: 1\n  max_num_seqs: 2\n")
    [problem] = problems_of(root)
    assert (problem.file, problem.key, problem.line) == (str(bad), "engine.max_num_seqs", 3)


def test_top_level_must_be_a_mapping(root: Path):
    write(root, "models/tiny.d/10.yaml", "- a\n- b\n")
    [problem] = problems_of(root)
    assert "top level must be a mapping" in problem.message


def test_recursive_alias_is_refused(root: Path):
    write(root, "models/tiny.d/10.yaml", "env: &a [*a]\n")
    [problem] = problems_of(root)
    assert "recursive alias" in problem.message


def test_every_problem_is_listed_across_files(root: Path):
    a = write(root, "models/tiny.d/10.yaml", "engine: {max_num_seqs: x, bogus: 1}\n")
    b = write(root, "models/tiny.d/20.yaml", "gateway: {retry_after: 0}\nlisten: nope\n")
    c = write(root, "models/tiny.d/30.yaml", "foo: [\n")
    got = {(p.file, p.key) for p in problems_of(root)}
    assert got == {
        (str(c), ""),
        (str(a), "engine.max_num_seqs"),
        (str(a), "engine.bogus"),
        (str(b), "gateway.retry_after"),
        (str(b), "listen"),
    }


def test_config_root_comes_from_argument_then_environment(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HOSTD_CONFIG_DIR", str(tmp_path))
    assert config.config_root() == tmp_path
    assert config.config_root("/x") == Path("/x")
    monkeypatch.delenv("HOSTD_CONFIG_DIR")
    assert config.config_root() == Path("/etc/hostd")


def test_daemon_config_errors_name_hostd_yaml(tmp_path: Path):
    bad = write(tmp_path, "hostd.yaml", "log_level: loud\n")
    problems = host_check.check(tmp_path)
    assert [(p.file, p.key) for p in problems] == [(str(bad), "log_level")]


# ---------------------------------------------------------------- fuzzing

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
known_keys = st.sampled_from(
    ["backend", "model", "engine", "gateway", "listen", "gpus", "env", "max_num_seqs",
     "max_model_len", "retry_after", "builtin", "vllm", "<<", "defaults"]
)
keys = known_keys | st.text(string.printable, max_size=10)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=documents, dropin=documents, daemon=documents)
def test_loader_raises_only_config_error_for_any_yaml_documents(tmp_path_factory, model, dropin, daemon):
    root = tmp_path_factory.mktemp("fuzz")
    write(root, "models/m.yaml", yaml.safe_dump(model))
    write(root, "models/m.d/10.yaml", yaml.safe_dump(dropin))
    write(root, "hostd.yaml", yaml.safe_dump(daemon))
    try:
        config.load_model("m", root)
    except config.ConfigError as exc:
        assert exc.problems and all(p.file for p in exc.problems)
    host_check.check(root)  # never raises: problems are returned


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_loader_raises_only_config_error_for_any_text(tmp_path_factory, text):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "models").mkdir()
    path = root / "models/m.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        loaded = config.load_model("m", root)
    except config.ConfigError as exc:
        # Refused: with at least one problem, each naming the file it is in.
        assert exc.problems and all(p.file == str(path) for p in exc.problems), exc.problems
    else:
        # Accepted (text that happens to be a model config): a typed config.
        assert isinstance(loaded.config, tuple(schema.MODEL_TYPES.values())), loaded.config


# ---------------------------------------------------------------- atomic writes


def test_write_atomic_replaces_content_with_mode_and_leaves_no_temp_file(tmp_path: Path):
    target = tmp_path / "tiny.d" / "90-reload.yaml"
    write_atomic(target, "engine: {max_num_seqs: 1}\n")
    write_atomic(target, "engine: {max_num_seqs: 2}\n", mode=0o640)
    assert target.read_text() == "engine: {max_num_seqs: 2}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(target.parent) == ["90-reload.yaml"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path: Path):
    target = tmp_path / "90-reload.yaml"
    write_atomic(target, "old\n")
    with pytest.raises(TypeError):
        write_atomic(target, b"not text")  # fails mid-write
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["90-reload.yaml"]


def test_shipped_example_config_is_valid():
    example = Path(__file__).resolve().parents[2] / "etc"
    assert host_check.check(example) == []
    assert config.list_models(example) == ["tiny"]


# ---------------------------------------------------------------- quantization


@pytest.mark.parametrize("backend, method", [("vllm", "fp9"), ("vllm", "FP8"), ("sglang", "fp8_per_block")])
def test_a_quantization_the_backend_does_not_know_is_refused_naming_the_key(tmp_path: Path, backend, method):
    bad = write(tmp_path, "models/q.yaml", f"backend: {backend}\nmodel: /m\nquantization: {method}\n")
    [problem] = problems_of(tmp_path, "q")
    assert (problem.file, problem.key) == (str(bad), "quantization")
    assert f"{method!r} is not a quantization method {backend} knows" in problem.message
    assert "fp8" in problem.message  # the methods it does know


@pytest.mark.parametrize("backend, method", [("vllm", "fp8"), ("vllm", "gptq"), ("sglang", "awq")])
def test_a_quantization_the_backend_knows_loads(tmp_path: Path, backend, method):
    write(tmp_path, "models/q.yaml", f"backend: {backend}\nmodel: /m\nquantization: {method}\n")
    assert config.load_model("q", tmp_path).config.quantization == method


@pytest.mark.parametrize("backend, fixture", [("vllm", "vllm-0.32.0"), ("sglang", "sglang-0.5.23")])
def test_the_quantization_tables_are_upstreams_methods(backend, fixture):
    """schema.QUANTIZATION_METHODS is what the real parsers know (recorded in
    tests/upstream/flags/ by generate_flags.py; test_contract.py checks the
    recording against the installed parsers), and every method on a weight
    cache allowlist is one of them."""
    import json

    from hostd.backends import sglang as sglang_backend
    from hostd.backends import vllm as vllm_backend

    flags = Path(__file__).resolve().parents[1] / "upstream" / "flags" / f"{fixture}.json"
    methods = json.loads(flags.read_text())["quantization_methods"]
    assert schema.QUANTIZATION_METHODS[backend] == frozenset(methods)
    allowlist = {"vllm": vllm_backend, "sglang": sglang_backend}[backend].QUANTIZATION_ALLOWLIST
    assert {m for m in allowlist if m} <= schema.QUANTIZATION_METHODS[backend]


def test_a_wrong_value_shadowed_by_a_later_dropin_is_refused_by_the_loader_as_by_the_check(root: Path):
    """Issue 22 B: `hostctl config --check` named 70-badtype.yaml, but the
    loader (what a reload, the generator and every daemon use) merged it
    away under 90-reload.yaml and accepted the tree."""
    bad = write(root, "models/tiny.d/70-badtype.yaml", "engine: {max_num_seqs: lots}\n")
    write(root, "models/tiny.d/90-reload.yaml", "engine: {max_num_seqs: 8}\n")
    found = problems_of(root)
    assert [(p.file, p.key) for p in found] == [(str(bad), "engine.max_num_seqs")]
    assert host_check.check(root, ["tiny"]) == found
    # With the reload's overlay (what the manager validates before writing) too.
    with pytest.raises(config.ConfigError) as overlay:
        config.load_model("tiny", root, overlay=("90-reload.yaml", "engine: {max_num_seqs: 16}\n"))
    assert [p.file for p in overlay.value.problems] == [str(bad)]


def test_a_dropin_is_validated_over_the_files_before_it_not_over_the_main_file_alone(root: Path):
    """A drop-in that switches the backend and one that sets that backend's
    field read as one tree: no problem is made up for the second file."""
    write(root, "models/tiny.d/10-vllm.yaml", "backend: vllm\n")
    write(root, "models/tiny.d/20-limits.yaml", "engine: {max_num_batched_tokens: 512}\n")
    write(root, "models/tiny.d/90-reload.yaml", "engine: {max_num_seqs: 8}\n")
    loaded = config.load_model("tiny", root)
    assert loaded.config.engine.max_num_batched_tokens == 512 and loaded.config.engine.max_num_seqs == 8
    assert host_check.check(root, ["tiny"]) == []


@pytest.mark.parametrize("listen, expected", [
    ("8000", "127.0.0.1:8000"),     # YAML's integer: docs/configuration.md's PORT, typed as admins type it
    ("'8000'", "127.0.0.1:8000"),   # the same port as a string
    ("0.0.0.0:8000", "0.0.0.0:8000"),
    ("'[::1]:8000'", "[::1]:8000"),
    ("/run/tiny.sock", "/run/tiny.sock"),
])
def test_listen_takes_a_bare_port_as_an_integer_or_a_string_and_means_loopback(root: Path, listen, expected):
    write(root, "models/tiny.d/10.yaml", f"listen: {listen}\n")
    cfg = config.load_model("tiny", root).config
    assert cfg.listen == expected
    from hostd import generator

    socket_unit = next(text for path, text in generator.dropins("tiny", cfg).items() if ".socket.d/" in path)
    assert f"ListenStream={expected}\n" in socket_unit


@pytest.mark.parametrize("listen, expected", [
    ("99999", "no port from 1 to 65535"),
    ("0", "no port from 1 to 65535"),
    ("true", "expected `int | str`, got `bool`"),
])
def test_listen_refuses_an_integer_that_is_no_port(root: Path, listen, expected):
    bad = write(root, "models/tiny.d/10.yaml", f"listen: {listen}\n")
    [problem] = problems_of(root)
    assert (problem.file, problem.key) == (str(bad), "listen")
    assert expected in problem.message, problem.message
