"""docs/configuration.md is generated from the schema; this fails when they drift."""

from pathlib import Path

from hostd.config import reference, schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_schema():
    assert DOC.read_text() == reference.render(), (
        "docs/configuration.md is stale: run "
        "`python -m hostd.config.reference > docs/configuration.md`"
    )


def test_reference_names_every_key_of_every_backend():
    text = DOC.read_text()
    for backend, engine in schema.ENGINE_TYPES.items():
        assert f"## Backend `{backend}`" in text
        for key in engine.__struct_fields__:
            assert f"`engine.{key}`" in text
