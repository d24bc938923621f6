"""Which requests an engine that died may have taken are sent once more.

One job: say whether a request that reached an engine which then died,
before any byte of its answer reached the client, may be sent once to the
standby. A request that never reached an engine (no connection) is always
sent there; this module is about the ones that may have run. Running one
twice must cost the client nothing it could notice, so only generation
without side effects is retried (RETRIED), and only when its body names none
of the fields that make the answer an action (ACTIONS).

The body is parsed here only, once, and only when an engine died under the
request: the gateway forwards bodies unread otherwise. Only the top-level
keys are looked at (msgspec skips the rest without building it).

Trusts: nothing of the body; one that is not a JSON object is not retried.
"""

from __future__ import annotations

import msgspec

# (method, path) -> why sending it twice is harmless.
RETRIED = {
    ("POST", "/v1/completions"): "generation reads the model and writes nothing; a second run is a new sample",
    ("POST", "/v1/chat/completions"): "as completions, unless the body asks for a tool call (ACTIONS)",
}

# Body keys that make a generation's answer an action the client takes (call
# a tool, a function): a second run could hand it a different call after the
# first one's was half seen, so such a request gets the engine-down error and
# the client decides. Present at all, with any value, counts.
ACTIONS = ("tools", "functions", "tool_choice")


class _Actions(msgspec.Struct):
    """The ACTIONS keys of a body, undecoded (msgspec.Raw: empty when absent)."""
    tools: msgspec.Raw = msgspec.Raw()
    functions: msgspec.Raw = msgspec.Raw()
    tool_choice: msgspec.Raw = msgspec.Raw()


_decoder = msgspec.json.Decoder(_Actions)


def retried(method: str, path: str, body: bytes | bytearray) -> bool:
    """May this request, which an engine that died may have run, run once more?"""
    if (method, path) not in RETRIED:
        return False
    try:
        found = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return not any(len(getattr(found, key)) for key in ACTIONS)
