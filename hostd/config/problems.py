"""What is wrong with hostd's configuration, as every reader reports it.

One job: the types of a configuration problem (Problem: file, key path,
message, line) and of the error that carries them (ConfigError), shared by
the YAML reader (yaml_files.py), the loader (load.py) and the host-wide
check (hostd/host_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

KeyPath = tuple[str, ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration."""

    file: str
    key: str  # dotted key path, "" for the whole file
    message: str
    line: Optional[int] = None  # 1-based

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        key = f" {self.key}:" if self.key else ""
        return f"{where}:{key} {self.message}"


class ConfigError(Exception):
    """The configuration is invalid; `problems` lists every problem found."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class NoSuchModel(ConfigError):
    """NAME names no configured model: a name the rule refuses, or no NAME.yaml."""

    def __init__(self, path: Path, reason: str):
        super().__init__([Problem(str(path), "", reason)])
        self.reason = reason


def dotted(path: KeyPath) -> str:
    return ".".join(path)


