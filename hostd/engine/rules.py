"""What the builtin engine refuses at start that needs no device: the rules
known from the config, the checkpoint's config.json and the installed
transformers' version alone.

One job: say those refusals in one place, without torch, so that the engine
at start (before it attaches any weights), the manager's Reload validation
(before anything is torn down), `hostctl reload --check` and `hostctl config
--check` refuse with the same words (BuiltinBackend.start_refusals). What
needs the model built or the device (a max_model_len past the positions the
model was built with is the engine's own to say: a reload rolls back when
it does) stays the engine's.

- the builtin backend runs on torch and transformers, which only the
  ``builtin`` extra installs (``pip install 'hostd[builtin]'``): a host
  that serves vLLM or SGLang models has neither, and a builtin model there
  is refused naming that command;
- the batched engine (``engine.batching: continuous``) runs only on the
  transformers minor hostd/engine/batch.py is tested with, since it replaces
  internals of transformers' continuous batching: another version is
  refused naming the version found, the one needed and ``engine.batching:
  none`` as the way out;
- its paged KV budget holds at least one request of ``max_model_len``
  tokens, in whole pages of the device's page size.

Trust: the config is the administrator's and has been validated; config.json
is read for positive integers only (budget.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hostd import kv_bytes
from hostd.engine import budget

# The transformers releases batch.py is tested with (pyproject.toml pins the
# same: tests/unit/test_batch_runner.py keeps the two in step).
TESTED_TRANSFORMERS = SpecifierSet(">=5.24,<5.25")


# What the builtin backend imports to run a model, and the extra that
# installs them (pyproject.toml): hostd's own dependencies leave them out so
# that a vLLM or SGLang host carries no second multi-GB torch beside upstream's.
BUILTIN_PACKAGES = ("torch", "transformers")
BUILTIN_INSTALL = "pip install 'hostd[builtin]'"


def missing_builtin_packages() -> list[str]:
    """Which of BUILTIN_PACKAGES this interpreter (and so the builtin engine
    and weight daemon, which run it) cannot import; found without importing
    them (torch takes seconds)."""
    missing = []
    for package in BUILTIN_PACKAGES:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # blocked, or a module without a spec in sys.modules
            found = False
        if not found:
            missing.append(package)
    return missing


def builtin_install_hint(who: str, missing: list[str]) -> str:
    """WHO (a setting or a command) cannot run without MISSING (missing_builtin_packages()): the
    sentence that says so and names the command that installs them."""
    return (f"{who} needs torch and transformers (hostd's `builtin` extra), and hostd's environment "
            f"{sys.prefix} lacks {' and '.join(missing)}: install them with `{sys.executable} -m {BUILTIN_INSTALL}` "
            "(a CUDA build of torch first for GPUs)")


def builtin_install_problem(missing: list[str]) -> Optional[str]:
    """Why the builtin backend cannot run with MISSING (missing_builtin_packages()) not
    importable, or None when nothing is missing."""
    if not missing:
        return None
    return builtin_install_hint("backend: builtin", missing) + ", or serve this model with backend: vllm or sglang"


def installed_transformers() -> Optional[str]:
    """The version of the transformers this interpreter (and so the engine
    unit, which runs it) would import; None when it is not installed."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def transformers_problem(version: Optional[str]) -> Optional[str]:
    """Why the batched engine cannot run on transformers VERSION, or None."""
    if version is None:
        found = "transformers is not installed"
    else:
        try:
            if TESTED_TRANSFORMERS.contains(Version(version), prereleases=True):
                return None
        except InvalidVersion:
            pass
        found = f"transformers {version} is installed"
    return (f"engine.batching: continuous needs transformers{TESTED_TRANSFORMERS} (the batched engine "
            f"replaces internals of its continuous batching and is tested with 5.24 only), but {found}; "
            "install that version, or set engine.batching: none in the model's config to serve with one "
            "worker thread per request")


def kv_problem(*, kv_cache_bytes: int, per_token: int, max_model_len: int, device: str) -> Optional[str]:
    """Why a paged cache of KV_CACHE_BYTES cannot hold one request of
    MAX_MODEL_LEN tokens (PER_TOKEN bytes each, in pages of the DEVICE's
    size), or None."""
    page = budget.PAGE_SIZE[device]
    blocks = kv_cache_bytes // (per_token * page)
    need = math.ceil(max_model_len / page)
    if blocks >= need:
        return None
    return (f"engine.kv_cache_mib: the KV budget of {kv_cache_bytes} bytes holds {blocks * page} tokens "
            f"({per_token} bytes each), fewer than one request of max_model_len={max_model_len}; "
            f"raise engine.kv_cache_mib to at least {(need * page * per_token + (1 << 20) - 1) >> 20} "
            "or lower engine.max_model_len")


def start_problems(cfg, model_config: dict, transformers_version: Optional[str]) -> list[str]:
    """Every rule of the module docstring that CFG (a builtin model config)
    breaks on the model whose config.json is MODEL_CONFIG, with
    TRANSFORMERS_VERSION installed; [] when it breaks none. A config.json
    that cannot size the cache is the engine's to refuse (it says which key)."""
    if cfg.engine.batching != "continuous":
        return []
    problems = []
    problem = transformers_problem(transformers_version)
    if problem:
        problems.append(problem)
    try:
        per_token = kv_bytes.bytes_per_token(model_config, cfg.dtype)
    except ValueError:
        return problems
    length = cfg.engine.max_model_len or budget.positions(model_config)
    # Unset, the budget is sized to hold one request at least (budget.py);
    # only an explicit engine.kv_cache_mib can be too small.
    if cfg.engine.kv_cache_mib is not None:
        problem = kv_problem(kv_cache_bytes=cfg.engine.kv_cache_mib << 20, per_token=per_token,
                             max_model_len=length, device=cfg.device)
        if problem:
            problems.append(problem)
    return problems
