"""hostd's YAML files: read one safely, and write one the loader reads back.

One job: a file's bytes to data with the line of every key path
(YamlFile), within the limits below, and data to the text root writes
(render_yaml). Merging and validation are load.py's.

Trust: the files are root's, read with the safe loader only; a file is
capped in size (MAX_FILE_BYTES) and nodes (MAX_NODES), must be a regular
file, and duplicate keys and recursive aliases are refused.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hostd.config.problems import ConfigError, KeyPath, Problem, dotted

MAX_FILE_BYTES = 1 << 20
MAX_NODES = 100_000


@dataclass
class YamlFile:
    """One parsed file: its data and the line of every key path in it."""

    path: str
    data: dict
    lines: dict[KeyPath, int] = field(default_factory=dict)


def read_yaml(path: Path) -> YamlFile:
    """Parse one YAML file whose top level must be a mapping (empty is {})."""
    name = str(path)
    try:
        content = read_regular_file(path, name)
    except OSError as exc:
        raise ConfigError([Problem(name, "", f"cannot read: {exc.strerror}")]) from None
    return parse_file(content, name)


def parse_file(content: bytes | str, name: str) -> YamlFile:
    """CONTENT as the file NAME, through every rule a config file's bytes meet
    on disk: at most MAX_FILE_BYTES, UTF-8 text, then parse_yaml's. read_yaml
    and an overlay (a drop-in not written yet) both come here."""
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")  # a lone surrogate: "not UTF-8" below
    if len(content) > MAX_FILE_BYTES:
        raise ConfigError([Problem(name, "", f"larger than {MAX_FILE_BYTES} bytes")])
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(name, "", f"not UTF-8 text ({exc.reason})")]) from None
    return parse_yaml(text, name)


def read_regular_file(path: Path, name: str) -> bytes:
    """The bytes of PATH, which must be a regular file of at most
    MAX_FILE_BYTES. Opened without blocking and checked on the open file
    (fstat), so a FIFO cannot hang the reader and a link to /dev/zero cannot
    exhaust its memory; a symlink to a regular file is fine."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([Problem(
                name, "", "not a regular file: config files must be regular files "
                "(not a FIFO, device, socket or directory)")])
        if st.st_size > MAX_FILE_BYTES:
            raise ConfigError([Problem(name, "", f"larger than {MAX_FILE_BYTES} bytes")])
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError([Problem(name, "", f"larger than {MAX_FILE_BYTES} bytes")])
        return data
    finally:
        os.close(fd)


def parse_yaml(text: str, name: str) -> YamlFile:
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        lines: dict[KeyPath, int] = {}
        if node is not None:
            _check_nodes(node, name, lines)
            data = loader.construct_document(node)
        else:
            data = {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        message = " ".join(str(m) for m in (exc.context, exc.problem) if m)
        raise ConfigError([Problem(name, "", f"malformed YAML: {message}", line)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(name, "", f"malformed YAML: {exc}")]) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise these for values such as a bad timestamp.
        raise ConfigError([Problem(name, "", f"malformed YAML value: {exc}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(
            [Problem(name, "", f"the top level must be a mapping of keys, not {kind}", 1)]
        )
    return YamlFile(name, data, lines)


def _check_nodes(root: yaml.Node, name: str, lines: dict[KeyPath, int]) -> None:
    """Refuse duplicate and non-string keys and recursive or exploding aliases;
    record the line of every key path."""
    seen = 0
    stack: list[tuple[yaml.Node, KeyPath, frozenset[int]]] = [(root, (), frozenset())]
    while stack:
        node, path, ancestors = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise ConfigError(
                [Problem(name, dotted(path), f"more than {MAX_NODES} YAML nodes (alias bomb?)")]
            )
        if id(node) in ancestors:
            raise ConfigError(
                [Problem(name, dotted(path), "recursive alias", node.start_mark.line + 1)]
            )
        inner = ancestors | {id(node)}
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    stack.append((value_node, path, inner))
                    continue
                line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != (
                    "tag:yaml.org,2002:str"
                ):
                    raise ConfigError(
                        [Problem(name, dotted(path), "keys must be plain strings", line)]
                    )
                if key_node.value in keys:
                    raise ConfigError(
                        [Problem(name, dotted(path + (key_node.value,)), "duplicate key", line)]
                    )
                keys.add(key_node.value)
                lines.setdefault(path + (key_node.value,), line)
                stack.append((value_node, path + (key_node.value,), inner))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                stack.append((item, path + (str(index),), inner))


def render_yaml(data: dict, name: str, header: str = "") -> str:
    """DATA as the text of a YAML file NAME that the loader will accept: the
    same limits (MAX_NODES values, MAX_FILE_BYTES) checked before anyone
    writes it. A ConfigError names the key whose value is too large."""
    seen = 0
    largest: dict[KeyPath, int] = {}
    stack: list[tuple[Any, KeyPath]] = [(data, ())]
    while stack:
        value, key = stack.pop()
        seen += 1
        if key:
            largest[key[:2]] = largest.get(key[:2], 0) + 1
        if seen > MAX_NODES:
            worst = max(largest, key=largest.__getitem__)
            raise ConfigError([Problem(
                name, dotted(worst), f"more than {MAX_NODES} values; the config loader refuses "
                "such a file, so it is not written")])
        if isinstance(value, dict):
            stack.extend((v, key + (str(k),)) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, key) for v in value)
    text = header + yaml.safe_dump(data, sort_keys=True)
    if len(text.encode()) > MAX_FILE_BYTES:
        sizes = {}
        for key, value in data.items():
            for inner, item in (value.items() if isinstance(value, dict) else [("", value)]):
                sizes[dotted((str(key), str(inner)) if inner else (str(key),))] = len(yaml.safe_dump(item))
        worst = max(sizes, key=sizes.__getitem__) if sizes else ""
        raise ConfigError([Problem(
            name, str(worst), f"the file would be larger than {MAX_FILE_BYTES} bytes; the config "
            "loader refuses such a file, so it is not written")])
    return text


