"""A workflow config checked against its JSON schema and completed with the schema's defaults.

The defaults live in one place, ``workflow/schemas/config.schema.yaml`` (shipped in the package as
``stagereplay/resources/config.schema.yaml``), and one function fills
them in: ``resolve_config``, which the workflow (common.smk) and ``stagereplay plan`` both call,
so a key's default can never differ between what runs and what is projected.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import jsonschema
import yaml

# Package data (stagereplay/resources), so an installed copy finds it too; in a checkout it is a link to
# the workflow's file, resolved here so that a message names that one file.
SCHEMA = Path(str(files("stagereplay.resources") / "config.schema.yaml")).resolve()
# The Snakefile's own configfile, which snakemake reads relative to its working directory (where it
# runs, or --directory) and merges a --configfile over, key by key; where it is absent, it is skipped.
WORKFLOW_CONFIG = Path("config") / "config.yaml"


class ConfigError(ValueError):
    """One-line message naming the key, the problem and the fix."""


def config_problem(config: dict, schema_path: str | Path = SCHEMA) -> str | None:
    """The most relevant schema violation as one line, or None when the config is valid."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is None:
        return None
    key = ".".join(str(part) for part in error.absolute_path) or "(top level)"
    fix = "fix it in your config file"
    if _typed_by_yaml_only(validator, error):
        fix = (
            "unquote it; if it came from snakemake --config, which passes a value inside a mapping as a string,"
            " give that override in a YAML file, as a second --configfile"
        )
    return f"config key {key}: {error.message} — {fix} (allowed keys and values: {schema_path})"


def _typed_by_yaml_only(validator, error) -> bool:
    """A string where the schema wants another type, which read as YAML would have that type: the mark of
    ``snakemake --config 'items={limit: 24}'``, whose nested values snakemake reads with YAML's base loader."""
    nested = len(error.absolute_path) > 1  # a top-level --config value is typed by snakemake itself
    if error.validator != "type" or not isinstance(error.instance, str) or not nested:
        return False
    try:
        value = yaml.safe_load(error.instance)
    except yaml.YAMLError:
        return False
    wanted = [error.validator_value] if isinstance(error.validator_value, str) else error.validator_value
    return not isinstance(value, str) and any(validator.is_type(value, name) for name in wanted)


def _filling_defaults(validator_class):
    """A validator that sets each property's schema default where the config leaves it out, wherever
    validation reaches (nested objects, every checkpoint's entry), as snakemake's ``validate`` does."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def resolve_config(config: dict, schema_path: str | Path = SCHEMA) -> dict:
    """``config`` checked (ConfigError: one line) and completed, in place, with the schema's defaults."""
    problem = config_problem(config, schema_path)
    if problem:
        raise ConfigError(problem)
    schema = yaml.safe_load(Path(schema_path).read_text())
    _filling_defaults(jsonschema.Draft202012Validator)(schema).validate(config)
    return config


def merged(base: dict, update: dict) -> dict:
    """``update`` over ``base``, nested mappings merged key by key (snakemake.utils.update_config)."""
    result = dict(base)
    for key, value in update.items():
        result[key] = (
            merged(result[key], value) if isinstance(value, dict) and isinstance(result.get(key), dict) else value
        )
    return result


def load_config(path: str | Path, overrides: dict | None = None, workdir: str | Path = ".") -> dict:
    """A config file, with ``overrides`` on top, resolved as ``snakemake --configfile PATH`` run in
    ``workdir`` resolves it: merged over the Snakefile's configfile where that lies there."""
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
        base = Path(workdir) / WORKFLOW_CONFIG
        if base.is_file() and base.resolve() != Path(path).resolve():
            # snakemake loads the --configfile, updates it with the base and then with the --configfile again:
            # the given file's keys come first (the first checkpoint is the primary one) and win.
            config = merged(merged(config, yaml.safe_load(base.read_text()) or {}), config)
        config = {**config, **(overrides or {})}
    except OSError as error:
        raise ConfigError(
            f"config file {path} not readable ({error.strerror}) — give the --configfile of the run"
        ) from None
    return resolve_config(config)
