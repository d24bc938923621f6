"""The model YAML of docs/vllm.md's and docs/sglang.md's quickstarts is valid
for hostd's loader as written. docs/vllm.md's blocks also run for real
(tests/system/test_real_vllm.py); docs/sglang.md's cannot run here (SGLang's
server needs a GPU), so this is the check that keeps its YAML from drifting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hostd import config

DOCS = Path(__file__).resolve().parents[2] / "docs"
HEREDOC = re.compile(r"cat > /etc/hostd/models/([^/\s]+)\.yaml <<'YAML'\n(.*?)\nYAML\n", re.S)


@pytest.mark.parametrize("page, backend", [("vllm.md", "vllm"), ("sglang.md", "sglang")])
def test_the_quickstart_yaml_loads_as_written(tmp_path, page, backend):
    text = (DOCS / page).read_text()
    quickstart = text[text.index("\n## Quickstart"):]
    quickstart = quickstart[:quickstart.index("\n## ", 1)]
    [(name, body)] = HEREDOC.findall(quickstart)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / f"{name}.yaml").write_text(body + "\n")
    cfg = config.load_model(name, tmp_path).config
    assert cfg.backend == backend
    assert cfg.env.get("HOSTD_VLLM" if backend == "vllm" else "HOSTD_SGLANG_PYTHON", "").startswith("/opt/")
