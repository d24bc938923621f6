"""Run hostd's daemons by hand, outside systemd: the harness the tests and
the benchmarks share (not part of the installed package; it needs the test
extra).

- local.py: ModelTree (a model's weights daemon, engines and gateway in a
  temporary tree, as an administrator runs them by hand) and wait_for;
- tiny_llama.py: the tiny random Llama checkpoint real vLLM serves on CPU;
- upstream_envs.py: where packaging/setup-upstream.sh installs the real vLLM
  and SGLang.

The checkout must be on sys.path (pytest's pythonpath in pyproject.toml; the
benchmarks insert it themselves).
"""
