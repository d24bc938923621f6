#!/usr/bin/python
"""Ansible module: reload one hostd model with new limits, on this host.

Runs on the managed host and calls hostctl, the administrator's command line,
nothing else: `hostctl status NAME --json=short` (does the model serve),
`hostctl reload --check NAME KEY=VALUE... --json=short` in check mode (the
manager's validation and preflight, nothing changed) and `hostctl reload NAME
KEY=VALUE... --json=short` for the reload (the manager decides `unchanged`
when the engine runs these limits already). It trusts
hostctl's JSON (its documents of version 1: another version fails the task,
docs/dbus-api.md) and exit codes, and refuses a host whose model does not
serve: reloading it would prove nothing about the fleet.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: hostd_reload
short_description: reload a hostd model's editable limits (hostctl reload)
author: hostd
description:
  - Runs C(hostctl reload NAME KEY=VALUE) and waits for the reload's end.
    Changed when it ends C(done); ok when it ends C(unchanged) (the engine
    runs these limits already); failed for every other end (C(rolled-back),
    C(failed), C(cancelled)), a refusal, or a model that does not serve.
  - Check mode runs C(hostctl reload --check) (validation and preflight by the
    manager, nothing changed) and reports the keys that would change, with
    their values now and then, and the strategy that would run (a diff with
    C(--diff)); a reload the manager would refuse fails the task.
options:
  name:
    description: The model (C(/etc/hostd/models/NAME.yaml)).
    required: true
    type: str
  set:
    description: "Editable keys under C(engine:) and their new values, typed (C(384), not C(\"384\"))."
    required: true
    type: dict
  hostctl:
    description: The hostctl command on the host.
    default: hostctl
    type: str
notes:
  - Needs root or a member of C(hostd-admin) on the host (C(become)).
  - The values land in the host's C(NAME.d/90-reload.yaml), the manager's file.
"""

EXAMPLES = r"""
- name: New engine limits for tiny
  hostd_reload:
    name: tiny
    set:
      max_model_len: 384
      max_num_seqs: 8
  become: true

- name: One host of a rolling reload (rolling-reload.yml runs it with serial 1)
  hostd_reload:
    name: "{{ hostd_reload_model }}"
    set: "{{ hostd_reload_set }}"
    hostctl: /usr/local/bin/hostctl
  become: true
"""

RETURN = r"""
msg:
  description: One line, the model and the reload's end (or, in check mode, the keys that would change).
  returned: always
  type: str
  sample: "tiny: reload done (strategy overlap)"
state:
  description: >-
    The reload's end (done, unchanged, rolled-back, failed, cancelled), refused,
    or in check mode would-reload or unchanged.
  returned: when the model serves
  type: str
  sample: done
strategy:
  description: The strategy the manager ran or would run (overlap, standby, in-place ...).
  returned: when a reload ran or would run
  type: str
  sample: overlap
error:
  description: The manager's words when the reload did not end done or unchanged.
  returned: when a reload ran
  type: str
  sample: "cannot serve tiny: engine.max_model_len: 384 exceeds the model's max_position_embeddings (256)"
notes:
  description: The manager's notes on the reload.
  returned: when a reload ran or would run
  type: list
  elements: str
operation:
  description: The reload's D-Bus object path.
  returned: when a reload ran
  type: str
  sample: /org/hostd1/operation/1
changes:
  description: Check mode; each key that would change, with its value now and then.
  returned: in check mode
  type: dict
  sample: {"max_model_len": {"now": null, "then": 384}}
"""


import json

from ansible.module_utils.basic import AnsibleModule

SUCCESS_STATES = ("done", "unchanged")  # hostd/manager/api.py


HOSTCTL_JSON = 1  # the version of hostctl's --json documents this module reads


def run_json(module, argv):
    """hostctl's --json document's ok and data (hostd/hostctl_output.py), None
    for data when there is none or it is another version's."""
    rc, out, err = module.run_command(argv)
    try:
        document = json.loads(out) if out.strip() else None
    except ValueError:
        document = None
    if not isinstance(document, dict) or document.get("version") != HOSTCTL_JSON:
        return rc, False, None, err.strip()
    return rc, document.get("ok") is True, document.get("data"), err.strip()


def check_mode(module, name, hostctl, assignments):
    """--check: the manager's verdict (hostctl reload --check: validation and
    preflight, nothing changed), as Ansible's changed and diff."""
    rc, ok, verdict, err = run_json(module, [hostctl, "reload", "--check", name, *assignments, "--json=short"])
    if verdict is None or rc != 0 or not ok:
        words = (verdict or {}).get("message") or err
        module.fail_json(msg=f"{name}: the reload would be refused (hostctl reload --check, exit {rc}): {words}",
                         rc=rc, state="refused")
    changes = {key: {"now": c.get("old"), "then": c.get("new")} for key, c in verdict.get("changes", {}).items()}
    if verdict.get("outcome") == "unchanged":
        module.exit_json(changed=False, state="unchanged", changes={}, msg=f"{name}: {verdict.get('reason', 'unchanged')}")
    diff = {"before": "".join(f"{k}: {json.dumps(c['now'])}\n" for k, c in sorted(changes.items())),
            "after": "".join(f"{k}: {json.dumps(c['then'])}\n" for k, c in sorted(changes.items())),
            "before_header": f"{name} engine (running)", "after_header": f"{name} engine (after reload)"}
    module.exit_json(changed=True, state="would-reload", changes=changes, diff=diff, strategy=verdict.get("strategy"),
                     notes=verdict.get("notes", []),
                     msg=f"{name}: would reload " + ", ".join(f"{k} {c['now']} -> {c['then']}" for k, c in changes.items())
                     + f" (strategy {verdict.get('strategy')}: {verdict.get('reason')})")


def main():
    module = AnsibleModule(
        argument_spec=dict(name=dict(type="str", required=True), set=dict(type="dict", required=True),
                           hostctl=dict(type="str", default="hostctl")),
        supports_check_mode=True,
    )
    name, wanted, hostctl = module.params["name"], module.params["set"], module.params["hostctl"]
    if not wanted:
        module.fail_json(msg="hostd_reload: set: give at least one engine key and its value")
    rc, _, status, err = run_json(module, [hostctl, "status", name, "--json=short"])
    if status is None:
        module.fail_json(msg=f"hostctl status {name} failed (exit {rc}): {err}", rc=rc)
    if rc != 0:
        module.fail_json(msg=f"model {name} does not serve here (state {status.get('state')}): "
                             f"not reloaded; start it first (hostctl start {name})", rc=rc, model_state=status.get("state"))
    # Values as JSON scalars, which YAML (hostctl's KEY=VALUE) reads back as typed.
    assignments = [f"{key}={json.dumps(value)}" for key, value in wanted.items()]
    if module.check_mode:
        check_mode(module, name, hostctl, assignments)
    rc, _, result, err = run_json(module, [hostctl, "reload", name, *assignments, "--json=short"])
    if result is None:  # refused before it began: the manager's one line on stderr
        module.fail_json(msg=f"hostctl reload {name} refused (exit {rc}): {err}", rc=rc, state="refused")
    state = result.get("state")
    report = dict(state=state, strategy=result.get("strategy", ""), error=result.get("error", ""),
                  notes=result.get("notes", []), operation=result.get("path", ""))
    words = f"{name}: reload {state}" + (f" (strategy {report['strategy']})" if report["strategy"] else "")
    if report["error"]:
        words += f": {report['error']}"
    if state not in SUCCESS_STATES:
        module.fail_json(msg=words, rc=rc, **report)
    module.exit_json(changed=state == "done", msg=words, **report)


if __name__ == "__main__":
    main()
