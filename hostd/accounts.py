"""Is what model NAME is about to run as, and write into, the model's own?

One job: refuse, before the model's first unit starts, an account or a
directory that belongs to someone else. model@NAME.socket runs
`python -m hostd.accounts NAME` as its first command (ExecStartPre=, as root,
from hostd-generator), before `systemd-sysusers` creates the model's user;
every other unit of the model starts after that socket. `hostctl config
--check` asks the same questions (config.load.check). Two things would
otherwise hand the model what is not its own, or another account what the
model writes:

- systemd-sysusers keeps a user or group that exists already, whatever it
  was granted (groups, sudo rules, polkit rules): the model's user must be
  one hostd made for this model (comment "hostd model NAME"), or not exist.
- systemd chowns a unit's StateDirectory= and CacheDirectory= (here
  /var/lib/hostd/NAME and /var/cache/hostd/NAME), with what is in them, to
  the unit's user: an existing one must belong to root, the model's own
  user, or hostd's shared user `hostd` (which ran every model before each had
  its own). A uid no account has is a removed account's leftovers and is
  taken over.

Trusts: the account database (pwd, grp) and lstat, as root sees them. It
only reads (each refusal names the account or the path, and the owner),
except `--create NAME`: configuration management (the Ansible role) creates
the model's user before it writes the model's YAML root:USER 0640, so that
the file's group exists; it asks the same questions first, then runs
systemd-sysusers with the entry model@NAME.socket runs (sysusers_entry).
`--user NAME` prints the user only. Both refuse a NAME that is not a model
name (config.schema.model_name_problem) before using it anywhere.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import sys
from typing import Callable, Optional

from hostd import paths, units

SHARED_USER = "hostd"  # packaging/sysusers.conf: the template's user, owner of /var/lib/hostd


def account_problem(name: str) -> Optional[str]:
    """Why the account of model NAME's user, where it exists already, was not
    made by hostd for this model (model@NAME.socket creates it with the
    comment "hostd model NAME"), or None. systemd-sysusers keeps an existing
    user and gives a new one the gid of an existing group of its name, so
    such an account would carry whatever someone else granted it."""
    account = units.user(name)
    try:
        group = grp.getgrnam(account)
    except KeyError:
        group = None
    try:
        passwd = pwd.getpwnam(account)
    except KeyError:
        return f"the group {account} exists but no user of that name: it is not model {name!r}'s" if group else None
    if passwd.pw_gecos != f"hostd model {name}" or (group is not None and group.gr_gid != passwd.pw_gid):
        return (f"the user {account} (uid {passwd.pw_uid}) exists and was not created by hostd for model {name!r} "
                f"(comment {passwd.pw_gecos!r}); rename the model or remove that account")
    return None


def owner_name(uid: int) -> Optional[str]:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _uid(account: str) -> Optional[int]:
    try:
        return pwd.getpwnam(account).pw_uid
    except KeyError:
        return None


def directory_problems(name: str) -> list[str]:
    """One line for each directory systemd would chown to model NAME's user
    (its state and cache directories) that exists and belongs to another
    account: the path, its owner, and what to do."""
    account = units.user(name)
    allowed = {0, *(uid for uid in (_uid(account), _uid(SHARED_USER)) if uid is not None)}
    problems = []
    for directory in (paths.state_dir(name), paths.cache_dir(name)):
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"cannot inspect {directory}: {exc.strerror}")
            continue
        owner = owner_name(st.st_uid)
        if st.st_uid in allowed or owner is None:
            continue
        problems.append(
            f"{directory} is owned by {owner} (uid {st.st_uid}), not by root or model {name!r}'s user {account}; "
            f"systemd would hand it and everything in it to {account}: move it away or rename the model")
    return problems


def problems(name: str) -> list[str]:
    """Everything that stops model NAME from starting on what is its own."""
    account = account_problem(name)
    return ([account] if account else []) + directory_problems(name)


def sysusers_entry(name: str) -> str:
    """systemd-sysusers' line for model NAME's user (and its group): the
    comment is what account_problem recognises as hostd's."""
    return f'u {units.user(name)} - "hostd model {name}" {paths.STATE_ROOT}/{name}'


def create(name: str) -> int:
    """`--create NAME`: the model's user and group, as model@NAME.socket
    creates them at its first start, unless one of problems(NAME); prints
    the user and whether it was created."""
    found = problems(name)
    for problem in found:
        print(f"hostd: model {name}'s user is not created: {problem}", file=sys.stderr)
    if found:
        return 1
    existed = _uid(units.user(name)) is not None
    if not existed:
        subprocess.run(["systemd-sysusers", "--inline", sysusers_entry(name)], check=True)
    print(f"{units.user(name)} {'exists' if existed else 'created'}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    from hostd.config import schema

    argv = sys.argv[1:] if argv is None else argv
    mode = argv[0] if len(argv) == 2 and argv[0] in ("--user", "--create") else None
    if len(argv) != (2 if mode else 1):
        print("usage: python -m hostd.accounts [--user | --create] NAME", file=sys.stderr)
        return 2
    name = argv[-1]
    problem = schema.model_name_problem(name)
    if problem:
        print(f"hostd: {problem}", file=sys.stderr)
        return 1
    if mode == "--user":
        print(units.user(name))
        return 0
    if mode == "--create":
        return create(name)
    return refuse_start(name, problems(name))


def refuse_start(name: str, found: list[str]) -> int:
    """Each of FOUND on stderr (the journal) as why model NAME is not started; exit 1 when any."""
    for problem in found:
        print(f"hostd: model {name} is not started: {problem}", file=sys.stderr)
    return 1 if found else 0


def start_check(module: str, problems_of: Callable[[str], list[str]], argv: Optional[list[str]] = None) -> int:
    """`python -m MODULE NAME`, a check model@NAME.socket runs before the model
    starts (hostd.secretfiles): PROBLEMS_OF(NAME), as refuse_start says them."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} NAME", file=sys.stderr)
        return 2
    return refuse_start(argv[0], problems_of(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
