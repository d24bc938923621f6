"""hostd's configuration: schema (what is valid), load (files, merge, origins),
atomic (how the manager writes drop-ins)."""

from hostd.config.atomic import write_atomic
from hostd.config.load import (
    ConfigError,
    LoadedModel,
    NoSuchModel,
    Problem,
    config_root,
    dropin_dir,
    list_models,
    load_daemon,
    load_model,
    model_file,
)
from hostd.config.schema import editable_fields, model_name_problem

__all__ = [
    "ConfigError",
    "LoadedModel",
    "NoSuchModel",
    "Problem",
    "config_root",
    "dropin_dir",
    "editable_fields",
    "list_models",
    "load_daemon",
    "load_model",
    "model_file",
    "model_name_problem",
    "write_atomic",
]
