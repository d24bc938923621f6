"""Secrets of a model's config, and how everything hostd shows is cleaned of them.

One job: say which values are secret and replace them. Anyone on the system
bus may read a model's Config and RunningConfig, an ordinary user may run
`hostctl config NAME`, and the journal keeps every process's logged argv:
all of them show the keys and flags, never the values. Root reads the files.
"""

from __future__ import annotations

from typing import Any, Iterable

REDACTED = "<redacted>"

# Words of a flag's name (split at '-', '_' read as '-') that make its value a
# secret. Why each: vLLM's --hf-token (a Hugging Face token), its 0.33
# --seed-token (the seed channel's password), SGLang's and vLLM's --api-key and
# --admin-api-key (keys clients would present); 'secret' and 'password' for
# the flags of the same kind that other releases add. Whole words only:
# --tokenizer and --max-num-batched-tokens name no secret.
SECRET_WORDS = {"token", "secret", "password", "passwd"}
SECRET_PAIRS = {("api", "key")}

# Keys of the config whose values are flag lists (hostd/config/schema.py).
ARG_LISTS = ("extra_args", "engine_extra_args")


def secret_flag(flag: str) -> bool:
    """Is FLAG ("--hf-token", "--api_key") one whose value is a secret?"""
    if not flag.startswith("-"):
        return False
    words = flag.lstrip("-").replace("_", "-").lower().split("-")
    return bool(SECRET_WORDS.intersection(words)) or any(pair in zip(words, words[1:]) for pair in SECRET_PAIRS)


def argv(args: Iterable[str]) -> list[str]:
    """ARGS with the value of every secret flag replaced (--flag=VALUE and
    --flag VALUE both)."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        flag, eq, _value = arg.partition("=")
        if secret_flag(flag):
            if eq:
                out.append(f"{flag}={REDACTED}")
                continue
            hide_next = True
        out.append(arg)
    return out


def secret_env(name: str) -> bool:
    """Is env: NAME ("HF_TOKEN", "OPENAI_API_KEY") one whose value is a secret,
    by the words of SECRET_WORDS and SECRET_PAIRS ('_' splits them)? A path or
    a switch (HOSTD_VLLM, VLLM_NO_USAGE_STATS) names none."""
    words = name.lower().replace("-", "_").split("_")
    return bool(SECRET_WORDS.intersection(words)) or any(pair in zip(words, words[1:]) for pair in SECRET_PAIRS)


def holds_named_secrets(data: Any) -> bool:
    """Does DATA (one file's mapping) set an env: value whose name says it is a
    secret (secret_env), or a secret flag's value? What a file that others may
    read must not hold (host_check.exposure_warnings, hostd/secretfiles.py): every
    env: value is still redacted wherever hostd shows it (config() below), but
    only these make a readable file a leak."""
    if not isinstance(data, dict):
        return False
    env = data.get("env")
    if isinstance(env, dict) and any(secret_env(str(key)) for key in env):
        return True
    return any(isinstance(data.get(key), list) and argv(map(str, data[key])) != list(map(str, data[key]))
               for key in ARG_LISTS)


def config(data: dict) -> dict:
    """DATA (a config as plain data) with env: values and secret flags' values
    replaced by REDACTED, keys and flags kept."""
    out = dict(data)
    if isinstance(out.get("env"), dict):
        out["env"] = dict.fromkeys(out["env"], REDACTED)
    for key in ARG_LISTS:
        if isinstance(out.get(key), list):
            out[key] = argv(out[key])
    return out
