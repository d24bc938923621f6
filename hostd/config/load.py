"""Load, merge and validate hostd's YAML configuration.

One job: turn the files under the config root into typed config, remembering
which file every value came from. Nothing here writes; a broken file raises
ConfigError (every problem found, each naming the file, the key path and what
was expected) and the caller changes nothing.

Files, for model NAME, lowest first (a later file wins; mappings merge deeply,
any other value is replaced whole):

    hostd.yaml `defaults:`       keys shared by every model
    models/NAME.yaml             the model
    models/NAME.d/*.yaml         drop-ins, in lexical order of file name

Trust: the files are written by root. Still, YAML is parsed with the safe
loader only, files are capped in size, duplicate keys and recursive aliases
are refused, and a drop-in directory holding anything but *.yaml files (hidden
files aside) is an error rather than silently ignored.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import msgspec
import msgspec.inspect

from hostd import paths, units
from hostd.config import schema

DEFAULT_ORIGIN = "(default)"


def config_root(override: Optional[os.PathLike | str] = None) -> Path:
    """The config root: an explicit override, else $HOSTD_CONFIG_DIR, else /etc/hostd."""
    if override:
        return Path(override)
    return Path(os.environ.get("HOSTD_CONFIG_DIR") or paths.CONFIG_ROOT)


# The problem types and the YAML reader have rooms of their own; re-exported
# here, where every reader of the config has found them.
from hostd.config.problems import ConfigError, KeyPath, NoSuchModel, Problem, dotted  # noqa: E402,F401
from hostd.config.yaml_files import (  # noqa: E402,F401
    MAX_FILE_BYTES,
    MAX_NODES,
    YamlFile,
    parse_file,
    parse_yaml,
    read_regular_file,
    read_yaml,
    render_yaml,
)


# ---------------------------------------------------------------- merging


@dataclass
class Merged:
    """Merged data with, for every leaf key path, the file that set it."""

    data: dict = field(default_factory=dict)
    origins: dict[KeyPath, str] = field(default_factory=dict)
    lines: dict[KeyPath, tuple[str, int]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def add(self, source: YamlFile, data: Optional[dict] = None, prefix: KeyPath = ()) -> None:
        """Merge SOURCE (or DATA taken from it, found at PREFIX) over what is here."""
        self.files.append(source.path)
        self._merge(self.data, source.data if data is None else data, source, (), prefix)

    def _merge(self, into: dict, new: dict, source: YamlFile, path: KeyPath, prefix: KeyPath):
        for key, value in new.items():
            here = path + (key,)
            line = source.lines.get(prefix + here)
            if line is not None:
                self.lines[here] = (source.path, line)
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                self._merge(into[key], value, source, here, prefix)
                continue
            self._forget(here)
            into[key] = _copy(value)
            # Every key below a new subtree keeps its own line, so a problem
            # at engine.max_num_seqs points there, not at `engine:`.
            n, base = len(here), prefix + here
            for stale in [k for k in self.lines if len(k) > n and k[:n] == here]:
                del self.lines[stale]
            for below, below_line in source.lines.items():
                if len(below) > len(base) and below[: len(base)] == base:
                    self.lines[here + below[len(base):]] = (source.path, below_line)
            if isinstance(value, dict) and value:
                for leaf in _leaves(value, here):
                    self.origins[leaf] = source.path
            else:
                self.origins[here] = source.path

    def _forget(self, path: KeyPath) -> None:
        n = len(path)
        for key in [k for k in self.origins if k[:n] == path]:
            del self.origins[key]

    def origin(self, path: KeyPath) -> str:
        """The file that set PATH (or the nearest enclosing key), else (default)."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.origins:
                return self.origins[path[:n]]
        below = {f for k, f in self.origins.items() if k[: len(path)] == path}
        return below.pop() if len(below) == 1 else DEFAULT_ORIGIN

    def where(self, path: KeyPath) -> tuple[str, Optional[int]]:
        """The file and line of PATH, for error messages."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return self.lines[path[:n]]
        return (self.files[-1] if self.files else "(none)", None)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _leaves(data: dict, path: KeyPath) -> Iterable[KeyPath]:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + (key,))
        else:
            yield path + (key,)


# ---------------------------------------------------------------- validation

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")
_FIELD_MSG = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*): (?P<msg>.*)$", re.S)


def _error_path(error: msgspec.ValidationError) -> tuple[KeyPath, str, bool]:
    """(key path, message, can the key be dropped to look for more problems)."""
    match = _AT.match(str(error))
    message = match.group("msg")
    path: KeyPath = tuple(
        part for part in re.split(r"\.|\[(\d+)\]", match.group("path") or "") if part
    )
    if m := _UNKNOWN.match(message):
        return path + (m.group("key"),), "unknown key", True
    if m := _MISSING.match(message):
        return path + (m.group("key"),), "required key is missing", False
    if m := _FIELD_MSG.match(message):
        return path + (m.group("key"),), m.group("msg"), True
    return path, message.replace("Expected", "expected", 1), True


def _choices(type_: type, path: KeyPath) -> str:
    """The allowed values of the Literal field at PATH, for an error message."""
    info: Any = msgspec.inspect.type_info(type_)
    for key in path:
        while isinstance(info, (msgspec.inspect.Metadata, msgspec.inspect.UnionType)):
            info = info.type if isinstance(info, msgspec.inspect.Metadata) else info.types[0]
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        info = fields.get(key)
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.LiteralType):
        return "one of " + ", ".join(map(str, info.values))
    return "another value"


def _drop(data: dict, path: KeyPath) -> bool:
    node: Any = data
    for part in path[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    if path and isinstance(node, dict) and path[-1] in node:
        del node[path[-1]]
        return True
    return False


def validation_problem(error: msgspec.ValidationError, type_: type) -> tuple[KeyPath, str, bool]:
    """(key path, message as the loader words it, can the key be dropped) of
    ERROR, raised converting data to TYPE_: the words every refusal of a
    value uses (the loader's, the manager's check of a reload patch)."""
    path, message, droppable = _error_path(error)
    if message.startswith("Invalid enum value"):
        message = f"{message[len('Invalid enum '):]}; expected {_choices(type_, path)}"
    return path, message, droppable


def validate(merged: Merged, type_: type) -> Any:
    """Convert MERGED to TYPE_, or raise ConfigError with every problem found.

    msgspec stops at the first error; to report them all, the offending key is
    dropped from a copy and validation runs again."""
    data = _copy(merged.data)
    problems: list[Problem] = []
    dropped: set[KeyPath] = set()
    for _ in range(200):
        try:
            value = msgspec.convert(data, type_)
        except msgspec.ValidationError as exc:
            path, message, droppable = validation_problem(exc, type_)
            if path in dropped:
                break  # a required key we dropped ourselves: already reported
            dropped.add(path)
            file, line = merged.where(path)
            problems.append(Problem(file, dotted(path), message, line))
            if not (droppable and _drop(data, path)):
                break
        else:
            if not problems:
                return value
            break
    raise ConfigError(problems)


# ---------------------------------------------------------------- public API


@dataclass
class LoadedModel:
    """A model's effective config and where each value came from."""

    name: str
    config: schema.ModelConfig
    merged: Merged

    def origin(self, path: KeyPath) -> str:
        return self.merged.origin(path)


def model_file(name: str, root: Optional[Path] = None) -> Path:
    return config_root(root) / "models" / f"{name}.yaml"


def existing_model_file(name: str, root: Optional[Path] = None) -> Path:
    """NAME's YAML file; NoSuchModel when NAME breaks the name rule or has none."""
    main = model_file(name, root)
    # The name rule first: "../models/x" must not name a file that happens to exist.
    problem = schema.model_name_problem(name)
    if problem:
        raise NoSuchModel(main, problem)
    if not main.exists() and not main.is_symlink():  # a dangling link is a model whose file is broken
        raise NoSuchModel(main, f"no such model {name!r}: {main} does not exist")
    return main


def dropin_dir(name: str, root: Optional[Path] = None) -> Path:
    return config_root(root) / "models" / f"{name}.d"


def list_models(root: Optional[Path] = None) -> list[str]:
    """Names of the models configured under ROOT (valid names or not)."""
    models = config_root(root) / "models"
    if not models.is_dir():
        return []
    # Any entry, not only regular files: a FIFO or device named NAME.yaml is a
    # model whose config is broken (the loader says why), not a silent absence.
    return sorted(p.name[: -len(".yaml")] for p in models.glob("*.yaml") if not p.is_dir())


def load_daemon(root: Optional[Path] = None) -> schema.DaemonConfig:
    """hostd.yaml, or the defaults when it does not exist."""
    path = config_root(root) / "hostd.yaml"
    if not path.exists():
        return schema.DaemonConfig()
    source = read_yaml(path)
    merged = Merged()
    merged.add(source)
    return validate(merged, schema.DaemonConfig)


def dropin_files(name: str, root: Optional[Path] = None) -> list[Path]:
    """The drop-ins of NAME in the order they apply; anything else there is an error."""
    directory = dropin_dir(name, root)
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError([Problem(str(directory), "", "must be a directory of *.yaml drop-ins")])
    files, problems = [], []
    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue  # editors' swap files and the atomic writer's temp files
        if dropin_name_problem(entry.name) is None and entry.is_file():
            files.append(entry)
        else:
            problems.append(
                Problem(
                    str(entry),
                    "",
                    "not a *.yaml file: drop-ins must be files named *.yaml "
                    "(rename it, or move it out of the directory)",
                )
            )
    if problems:
        raise ConfigError(problems)
    return files


def dropin_name_problem(file_name: str) -> Optional[str]:
    """Why FILE_NAME cannot be a drop-in that applies, or None: drop-ins are
    NAME.d/*.yaml; hidden files (editors' swap files) are skipped."""
    if "/" in file_name or file_name.startswith(".") or not file_name.endswith(".yaml"):
        return f"{file_name!r} is not a drop-in file name: use a *.yaml name, not hidden, with no '/'"
    return None


def add_daemon_defaults(merged: Merged, root: Path) -> None:
    """The `defaults:` of hostd.yaml, under every model's own files."""
    daemon_file = root / "hostd.yaml"
    if daemon_file.exists():
        daemon = read_yaml(daemon_file)
        defaults = daemon.data.get("defaults")
        if isinstance(defaults, dict):
            merged.add(daemon, defaults, prefix=("defaults",))


# What a drop-in not written yet would hold: (its file name in NAME.d, its
# content as the file's bytes or text), e.g. ("90-reload.yaml", text).
Overlay = tuple[str, "bytes | str"]


def _model_sources(
    name: str, root: Optional[Path] = None, overlay: Optional[Overlay] = None
) -> tuple[Path, list[YamlFile], list[Problem]]:
    """The config root, every readable file of model NAME parsed in the order
    it applies (NAME.yaml, then its drop-ins; OVERLAY as merge_model says),
    and the problems of the files that could not be read."""
    root = config_root(root)
    main = existing_model_file(name, root)
    directory = dropin_dir(name, root)
    overlay_path = None
    if overlay is not None:
        problem = dropin_name_problem(overlay[0])
        if problem:
            raise ValueError(problem)  # the caller's constant: a bug, not a config problem
        overlay_path = directory / overlay[0]
    problems: list[Problem] = []
    try:
        dropins = dropin_files(name, root)
    except ConfigError as exc:
        dropins, problems = [], problems + exc.problems
    names = sorted({p.name for p in dropins} | ({overlay_path.name} if overlay_path else set()))
    sources: list[YamlFile] = []
    for path in [main, *(directory / n for n in names)]:
        try:
            if path == overlay_path:
                sources.append(parse_file(overlay[1], str(path)))
            else:
                sources.append(read_yaml(path))
        except ConfigError as exc:
            problems += exc.problems
    return root, sources, problems


def _merged(root: Path, sources: list[YamlFile]) -> Merged:
    merged = Merged()
    add_daemon_defaults(merged, root)
    for source in sources:
        merged.add(source)
    return merged


def merge_model(
    name: str, root: Optional[Path] = None, overlay: Optional[Overlay] = None
) -> tuple[Merged, list[Problem]]:
    """Read and merge every readable file of model NAME (values not validated);
    the problems of the files that could not be read come back beside it.

    OVERLAY (file name, content) stands in for that drop-in (or joins the
    directory) in its lexical place, its content going through every rule a
    file on disk meets (parse_file): what the tree would be if the file held
    it. Nothing is written."""
    root, sources, problems = _model_sources(name, root, overlay)
    return _merged(root, sources), problems


def _shadowed_problems(root: Path, sources: list[YamlFile]) -> list[Problem]:
    """What is wrong in each drop-in for its own types, whoever wins the merge:
    drop-in K validated over the files before it (NAME.yaml, drop-ins < K), its
    own problems kept. A wrong value that a later drop-in (the manager's
    90-reload.yaml, say) shadows in the merged result is still a wrong value in
    that file. The last file is the merged result's own: not repeated here."""
    problems: list[Problem] = []
    for k in range(1, len(sources) - 1):
        merged = _merged(root, sources[: k + 1])
        try:
            validate(merged, model_type(merged))
        except ConfigError as exc:
            problems += [p for p in exc.problems if p.file == sources[k].path and p not in problems]
    return problems


def model_type(merged: Merged) -> type:
    """The schema type for the backend named in MERGED."""
    backend = merged.data.get("backend")
    found = schema.MODEL_TYPES.get(backend) if isinstance(backend, str) else None
    if found is not None:
        return found
    file, line = merged.where(("backend",))
    message = (
        "required key is missing"
        if backend is None
        else f"unknown backend {backend!r}"
    )
    raise ConfigError(
        [Problem(file, "backend", f"{message}: expected one of builtin, vllm, sglang", line)]
    )


def load_model(name: str, root: Optional[Path] = None, overlay: Optional[Overlay] = None) -> LoadedModel:
    """The effective, validated config of model NAME; with OVERLAY (a drop-in
    file name and content, see merge_model), what it would be if that drop-in
    held that content. The one answer to "would this drop-in be valid": every
    problem found is reported, the unreadable files' and the values' together."""
    root, sources, problems = _model_sources(name, root, overlay)
    merged = _merged(root, sources)
    problems += user_problems(name, root)
    try:
        config = validate(merged, model_type(merged))
    except ConfigError as exc:
        # With a file unreadable, a missing backend is its consequence, not news.
        if not problems or "backend" in merged.data:
            problems += exc.problems
    problems += [p for p in _shadowed_problems(root, sources) if p not in problems]
    if problems:
        raise ConfigError(problems)
    return LoadedModel(name, config, merged)


def user_problems(name: str, root: Optional[Path] = None) -> list[Problem]:
    """Why model NAME cannot have its own user (hostd.units.user): it would be
    the admin group hostd.yaml names, or another model's user (two names
    hashing alike). systemd-sysusers would hand the existing account over,
    and with it that group's or that model's powers."""
    root = config_root(root)
    account = units.user(name)
    try:
        admin_group = load_daemon(root).admin_group
    except ConfigError:
        admin_group = schema.DaemonConfig().admin_group  # hostd.yaml's own problems are reported apart
    problem = units.user_problem(name, admin_group)
    if problem:
        return [Problem(str(model_file(name, root)), "", f"model {name!r} cannot be configured: {problem}; "
                        "rename the file (and its NAME.d)")]
    for other in list_models(root):
        if other != name and schema.model_name_problem(other) is None and units.user(other) == account:
            return [Problem(str(model_file(name, root)), "",
                            f"models {name!r} and {other!r} ({model_file(other, root)}) would both run as "
                            f"the user {account}: rename one of them")]
    return []
