"""tests/README.md's room map names every test file (issue 49): a reader who
looks for the tests of a room finds all of them, and a new file without a
place in the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "upstream", "system", "gpu", "gpu_system")


def unnamed(readme: str, tests: Path = TESTS) -> list[str]:
    return [f"{tier}/{path.name}" for tier in TIERS for path in sorted((tests / tier).glob("test_*.py"))
            if not re.search(rf"(?<!\w){re.escape(path.name)}", readme)]  # test_overlap.py is not test_reload_overlap.py


def test_the_map_names_every_test_file():
    assert unnamed((TESTS / "README.md").read_text()) == []


def test_a_file_the_map_lacks_is_found(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit/test_named.py").write_text("")
    (tmp_path / "unit/test_new_room.py").write_text("")
    (tmp_path / "unit/test_room.py").write_text("")  # inside another's name only
    assert unnamed("| x | test_named.py, test_new_test_room.py |", tmp_path) == ["unit/test_new_room.py", "unit/test_room.py"]
