"""Manual pages and bash completion, generated from what hostd really accepts.

One job: hostctl(1) and hostd(8) come from the argument parsers
(argparse-manpage), hostd.yaml(5) from the config schema (msgspec's type
introspection), and bash completion for both commands from the parsers
(shtab), so none of them can drift from the code. `hostd install` writes them
where man-db and bash-completion on Debian look for local files.
"""

from __future__ import annotations

from typing import Any

import msgspec

import hostd
from hostd.config import schema

DATE = "2026-11-30"  # fixed, so that two installs write the same files


def _manpage(parser, section: str, description: str) -> str:
    from argparse_manpage.manpage import Manpage

    data = {"manual_section": section, "manual_title": "hostd manual", "project_name": "hostd",
            "version": hostd.__version__, "description": description, "date": DATE}
    return str(Manpage(parser, _data=data))


def hostctl_page() -> str:
    from hostd import hostctl

    return _manpage(hostctl.build_parser(), "1", "control hostd's models (the CLI over org.hostd1)")


def hostd_page() -> str:
    from hostd import main

    return _manpage(main.build_parser(), "8", "hostd's daemons, install and checkpoint tools")


def _roff(text: str) -> str:
    return text.replace("\\", "\\e").replace("-", "\\-").replace("\n.", "\n\\&.")


def _type_name(t: Any) -> str:
    inspect = msgspec.inspect
    if isinstance(t, inspect.Metadata):
        return _type_name(t.type)
    if isinstance(t, inspect.UnionType):
        return " | ".join(_type_name(x) for x in t.types)
    if isinstance(t, inspect.LiteralType):
        return " | ".join(repr(v) for v in t.values)
    if isinstance(t, (inspect.ListType, inspect.SetType, inspect.FrozenSetType)):
        return f"list of {_type_name(t.item_type)}"
    if isinstance(t, inspect.DictType):
        return f"mapping of {_type_name(t.key_type)} to {_type_name(t.value_type)}"
    if isinstance(t, inspect.StructType):
        return "mapping"
    return type(t).__name__.removesuffix("Type").lower()


def _fields(struct: type, prefix: str, editable: set[str]) -> list[str]:
    lines = []
    info = msgspec.inspect.type_info(struct)
    for field in info.fields:
        key = f"{prefix}{field.name}"
        t = field.type.type if isinstance(field.type, msgspec.inspect.Metadata) else field.type
        default = "required" if field.required else f"default {field.default!r}"
        if field.default is msgspec.NODEFAULT and not field.required:
            value = field.default_factory()
            default = "defaults below" if isinstance(value, msgspec.Struct) else f"default {value!r}"
        kind = "editable by a reload" if field.name in editable and prefix == "engine." else "fixed"
        lines.append(f".TP\n.B {_roff(key)}\n{_roff(_type_name(field.type))}; {_roff(default)}; {kind}.")
        if isinstance(t, msgspec.inspect.StructType):
            lines += _fields(t.cls, f"{key}.", editable)
    return lines


def hostd_yaml_page() -> str:
    """hostd.yaml(5): every key of the model files per backend, and hostd.yaml."""
    out = [
        f'.TH HOSTD.YAML "5" "{DATE}" "hostd {hostd.__version__}" "File Formats"',
        ".SH NAME",
        "hostd.yaml \\- hostd's configuration: /etc/hostd/hostd.yaml and /etc/hostd/models/NAME.yaml",
        ".SH DESCRIPTION",
        "One YAML file per model, /etc/hostd/models/NAME.yaml, with drop-ins in "
        "/etc/hostd/models/NAME.d/*.yaml merged over it in lexical order (mappings deep-merged). "
        "Check with \\fBhostctl config \\-\\-check\\fR; show the effective values with their files "
        "with \\fBhostctl config NAME\\fR. Fixed keys change only with \\fBsystemctl restart "
        "model@NAME\\fR; editable keys (under engine:) with \\fBsystemctl reload model@NAME\\fR.",
    ]
    for backend, struct in schema.MODEL_TYPES.items():
        out.append(f".SH MODEL KEYS: backend: {backend}")
        out += _fields(struct, "", set(schema.editable_fields(backend)))
    out.append(".SH DAEMON KEYS: /etc/hostd/hostd.yaml")
    out += _fields(schema.DaemonConfig, "", set())
    out += [".SH SEE ALSO", "hostctl(1), hostd(8), systemd.unit(5)"]
    return "\n".join(out) + "\n"


def pages() -> dict[str, str]:
    """Path below the man directory -> page."""
    return {"man1/hostctl.1": hostctl_page(), "man8/hostd.8": hostd_page(),
            "man5/hostd.yaml.5": hostd_yaml_page()}


def completions() -> dict[str, str]:
    """Command -> its bash completion script."""
    import shtab

    from hostd import hostctl, main

    return {"hostctl": shtab.complete(hostctl.build_parser(), shell="bash"),
            "hostd": shtab.complete(main.build_parser(), shell="bash")}


if __name__ == "__main__":  # a look at one: python -m hostd.manpages | man -l -
    print(hostd_yaml_page())
