"""README.md's statements about reload strategies and GPUs, checked against
the code (issue 55 item 1): the default it names is the schema's default of
reload.strategy, which every backend's model shares; every strategy an
administrator may set is named; and its GPU statement points at the ledger
that says which CUDA tests passed at which commit."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from hostd.config import schema

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_default_strategy_the_readme_names_is_the_schemas_for_every_backend():
    for backend, model_type in schema.MODEL_TYPES.items():
        assert typing.get_type_hints(model_type)["reload"] is schema.ReloadConfig, backend
    assert f"- `{schema.ReloadConfig().strategy}`, the default for every backend" in README


def test_every_strategy_an_administrator_may_set_is_in_the_readme():
    strategy = typing.get_type_hints(schema.ReloadConfig, include_extras=True)["strategy"]
    names = typing.get_args(typing.get_args(strategy)[0])
    assert len(names) >= 3 and all(f"`{name}`" in README for name in names), names


def test_the_gpu_statement_names_the_ledger_and_what_never_ran_on_a_gpu():
    said = re.search(r"What has run on a GPU:(.*?)\n\n", README, re.S).group(1)
    assert "tests/gpu/README.md" in said and "never on a GPU" in said
    assert (ROOT / "tests/gpu/README.md").read_text().count("| `tests/gpu") > 10
