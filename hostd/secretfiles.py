"""Are model NAME's secrets (env: values named as secrets, secret flags' values) in files that only
root and the model's user may read? Refuse to start the model if not, as ssh
refuses a private key that others can read.

One job: model@NAME.socket runs `python -m hostd.secretfiles NAME` (as root,
from hostd-generator) right after systemd-sysusers has created the model's
user, before any other unit of the model starts. For each of the model's
files (NAME.yaml and its drop-ins) that holds a secret (an env: name with
TOKEN, SECRET, PASSWORD or API KEY in it, or a secret flag's value:
config.redact.holds_named_secrets; a path or a switch in env: is none)
and that someone else can read (every user, another group's members, or
another owner), it prints the file, who else reads it and the chown/chmod
that keep it to root and the model's user, and exits 1: the socket does not
start, so neither does the model. The group in that chown exists at this
point, since sysusers ran first. The rule is the one `hostctl config
--check` warns with and the manager's Model.StartProblem shows
(host_check.exposure_warnings).

Trusts: stat and the account database, as root sees them. It only reads.
"""

from __future__ import annotations

import sys
from typing import Optional

from hostd import accounts, host_check


def problems(name: str, root=None) -> list[str]:
    """One line for each file of model NAME whose secrets others can read."""
    return host_check.exposure_warnings(root, [name])


def main(argv: Optional[list[str]] = None) -> int:
    return accounts.start_check("hostd.secretfiles", problems, argv)


if __name__ == "__main__":
    sys.exit(main())
