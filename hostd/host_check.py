"""The host-wide check behind `hostctl config --check`: every problem of
hostd.yaml and the models' files, alone, merged and against each other.

One job: find what is wrong before anything reads it (the loader in
load.py refuses a broken file when a process starts; this reports all of
them at once, for an administrator, Ansible's validate: and the like). What
only a backend knows comes through the Backend handed in (BackendOf). It
reads config/ and the accounts (the model's user), so it sits above both,
not inside config/ (which imports nothing above it).

Trust: the files are the administrator's; nothing here writes anything
(check_candidate works on a scratch copy).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from hostd import accounts, units
from hostd.config import redact, schema
from hostd.config.load import (
    DEFAULT_ORIGIN,
    ConfigError,
    LoadedModel,
    Problem,
    config_root,
    dropin_dir,
    dropin_files,
    dropin_name_problem,
    list_models,
    load_daemon,
    load_model,
    model_file,
    read_regular_file,
    read_yaml,
)


def exposure_warnings(root: Optional[Path] = None, names: Optional[list[str]] = None) -> list[str]:
    """One line for each model file (NAME.yaml or a drop-in) that holds a
    secret (an env: value whose name says so, or a secret flag's value:
    redact.holds_named_secrets) and that others than root and the
    model's own user may read (as ssh refuses an unprotected key): every
    user (the mode), another group (0640 of the group users is not
    private) or another owner; the file, who else reads it, and the owner,
    group and mode that keep it to root and the model's user."""
    root = config_root(root)
    warnings = []
    for name in list_models(root) if names is None else names:
        if schema.model_name_problem(name) is not None:
            continue
        try:
            files = [model_file(name, root), *dropin_files(name, root)]
        except ConfigError:
            continue
        for path in files:
            try:
                st = path.stat()
                data = read_yaml(path).data
            except (OSError, ConfigError):
                continue  # check() reports unreadable files
            others = _other_readers(st, name)
            if others and redact.holds_named_secrets(data):
                group = units.user(name)
                warnings.append(
                    f"{path} holds env: values or secret flags' values that are secrets and is readable by {others} "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); keep it to root and the model's user: "
                    f"chown root:{group} {path} && chmod 0640 {path}")
    return warnings


def _other_readers(st: os.stat_result, name: str) -> Optional[str]:
    """Who besides root and model NAME's user may read a file of stat ST, or None."""
    import grp
    import pwd

    def account(lookup, key):
        try:
            return lookup(key)
        except KeyError:
            return None

    own = account(pwd.getpwnam, units.user(name))
    own_group = account(grp.getgrnam, units.user(name))
    if st.st_mode & stat.S_IROTH:
        return "every user"
    if st.st_mode & stat.S_IRGRP and st.st_gid not in {0, *([own_group.gr_gid] if own_group else [])}:
        group = account(grp.getgrgid, st.st_gid)
        return f"the group {group.gr_name if group else st.st_gid}'s members"
    if st.st_mode & stat.S_IRUSR and st.st_uid not in {0, *([own.pw_uid] if own else [])}:
        owner = account(pwd.getpwuid, st.st_uid)
        return f"its owner {owner.pw_name if owner else f'uid {st.st_uid}'}"
    return None


#: The Backend of a model config (hostd.backends.for_config), handed in by
#: the caller (hostctl): what only a backend knows (its start-time refusals,
#: the engine key that reserves a share of a GPU) comes through it, so this
#: module and config/ below it stay free of the backends' imports.
BackendOf = Callable[[Any], Any]


def rule_problems(loaded: LoadedModel, found: list[str], root: Path) -> list[Problem]:
    """FOUND (a backend's refusals, each "key.path: why") as Problems naming
    the file and line that set the key (the model's YAML for a default)."""
    problems = []
    for message in found:
        key, sep, why = message.partition(": ")
        if not (sep and key.replace("_", "").replace(".", "").isalnum()):
            key, why = "", message
        path = tuple(key.split(".")) if key else ()
        origin = loaded.merged.origin(path) if path else DEFAULT_ORIGIN
        file, line = loaded.merged.where(path) if origin != DEFAULT_ORIGIN else (None, None)
        problems.append(Problem(file or str(model_file(loaded.name, root)), key, why, line))
    return problems


def check(root: Optional[Path] = None, names: Optional[list[str]] = None,
          backend_of: Optional[BackendOf] = None) -> list[Problem]:
    """Every problem in hostd.yaml and the given models (default: all); with
    BACKEND_OF (hostctl hands in hostd.backends.for_config), also what each
    model's backend says of it: what the engine would refuse at start
    (start_refusals) and GPUs promised more than all of their memory."""
    root = config_root(root)
    problems: list[Problem] = []
    try:
        load_daemon(root)
    except ConfigError as exc:
        problems += exc.problems
    models_dir = root / "models"
    if names is None:
        names = list_models(root)
        if models_dir.is_dir():
            for entry in sorted(models_dir.iterdir()):
                stem = entry.name[: -len(".d")] if entry.name.endswith(".d") else None
                if entry.is_dir() and stem and not (models_dir / f"{stem}.yaml").exists():
                    problems.append(
                        Problem(str(entry), "", f"drop-ins for {stem!r}, which has no {stem}.yaml")
                    )
    for name in names:
        try:
            loaded = load_model(name, root)  # every file for its own types too (_shadowed_problems)
        except ConfigError as exc:
            problems += exc.problems
        else:
            if backend_of is not None:
                cfg = loaded.config
                problems += rule_problems(loaded, backend_of(cfg).start_refusals(cfg), root)
        # What model@NAME.socket's first command refuses (hostd/accounts.py).
        if schema.model_name_problem(name) is None:
            problems += [Problem(str(model_file(name, root)), "", found) for found in accounts.problems(name)]
    return problems + across_models_problems(root, names, backend_of)


def across_models_problems(root: Path, names: list[str], backend_of: Optional[BackendOf] = None) -> list[Problem]:
    """What no single file shows: NAMES against every model of ROOT (those
    that load): two models on one `listen` address (the second gateway could
    not bind it), and, with BACKEND_OF, a GPU whose models reserve more than
    all of it (the engine fractions their backends name sum above 1)."""
    loaded = {}
    for name in list_models(root):
        try:
            loaded[name] = load_model(name, root).config
        except ConfigError:
            continue  # its own problems are reported on their own
    problems: list[Problem] = []
    for name in names:
        cfg = loaded.get(name)
        if cfg is None:
            continue
        for other, other_cfg in loaded.items():
            if other < name and other_cfg.listen == cfg.listen:
                problems.append(Problem(str(model_file(name, root)), "listen",
                                        f"{cfg.listen!r} is also model {other!r}'s listen address "
                                        f"({model_file(other, root)}): two gateways cannot serve one address"))
    if backend_of is None:
        return problems
    # By the name in `gpus:` (an index or a UUID): without NVML here, index 0
    # and GPU 0's UUID are not known to be one GPU.
    reserved: dict[int | str, list[tuple[str, str, float]]] = {}
    for name, cfg in loaded.items():
        backend = backend_of(cfg)
        fraction = backend.memory_fraction(cfg) if backend.uses_gpu(cfg) else None
        if fraction:
            for gpu in cfg.gpus:
                reserved.setdefault(gpu, []).append((name, backend.memory_fraction_key, fraction))
    # Indices in their order, then UUIDs.
    for gpu, shares in sorted(reserved.items(), key=lambda item: (isinstance(item[0], str), str(item[0]).zfill(4))):
        total = sum(fraction for _, _, fraction in shares)
        mine = [name for name, _, _ in shares if name in names]
        if total > 1.0 and mine:
            listed = ", ".join(f"{name} {key}={fraction}" for name, key, fraction in shares)
            problems.append(Problem(str(model_file(mine[0], root)), "gpus",
                                    f"GPU {gpu} is promised {total:.2f} of its memory ({listed}); "
                                    f"the engines on one GPU can reserve at most all of it (1.0)"))
    return problems


def check_candidate(candidate: Path, target: str, root: Optional[Path] = None,
                    backend_of: Optional[BackendOf] = None) -> list[Problem]:
    """Problems of CANDIDATE as if it were installed as TARGET, without
    installing it: TARGET is a model NAME (its NAME.yaml) or NAME.d/FILE.yaml
    (a drop-in of NAME). The check runs on a copy of ROOT's hostd.yaml and the
    model's files with the candidate in place, so a drop-in is validated
    merged with the files it lands among, and the problems name CANDIDATE and
    ROOT's paths (for Ansible's validate:, Salt's check_cmd, Puppet's validate_cmd)."""
    root = config_root(root)
    name, _, dropin = target.partition(".d/")
    if schema.model_name_problem(name):
        return [Problem(target, "", f"--as: {schema.model_name_problem(name)}")]
    if dropin and dropin_name_problem(dropin):  # also refuses a '/' in it
        return [Problem(target, "", f"--as: {dropin_name_problem(dropin)}")]
    try:
        content = read_regular_file(candidate, str(candidate))
    except ConfigError as exc:
        return exc.problems
    with tempfile.TemporaryDirectory(prefix="hostd-check-") as scratch:
        copy = Path(scratch)
        (copy / "models").mkdir()
        if (root / "hostd.yaml").is_file():
            shutil.copyfile(root / "hostd.yaml", copy / "hostd.yaml")
        for other in list_models(root):  # the others: for the checks across models
            if other != name or dropin:
                shutil.copyfile(model_file(other, root), copy / "models" / f"{other}.yaml")
        if dropin_dir(name, root).is_dir():
            shutil.copytree(dropin_dir(name, root), copy / "models" / f"{name}.d")
        placed = copy / "models" / (f"{name}.d/{dropin}" if dropin else f"{name}.yaml")
        placed.parent.mkdir(parents=True, exist_ok=True)
        placed.write_bytes(content)
        if dropin and not (copy / "models" / f"{name}.yaml").exists():
            return [Problem(target, "", f"--as: model {name!r} has no {model_file(name, root)} to drop in beside")]
        problems = check(copy, [name], backend_of)
    def where(path: str) -> str:
        if path == str(placed):
            return str(candidate)
        return path.replace(scratch, str(root), 1)
    return [Problem(where(p.file), p.key, p.message.replace(scratch, str(root)), p.line) for p in problems]
