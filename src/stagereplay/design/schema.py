"""A workflow config checked against its JSON schema and completed with the schema's defaults.

The defaults live in one place, ``workflow/schemas/config.schema.yaml`` (shipped in the package as
``stagereplay/resources/config.schema.yaml``): they are the default run's, and the Snakefile names no
configfile of its own, so a config file means the same from any working directory. One function fills
them in: ``resolve_config``, which the workflow (common.smk), ``stagereplay plan`` and ``stagereplay
config`` all call, so a key's default can never differ between what runs and what is shown.
"""

from __future__ import annotations

import copy
from importlib.resources import files
from pathlib import Path

import jsonschema
import yaml

# Package data (stagereplay/resources), so an installed copy finds it too; in a checkout it is a link to
# the workflow's file, resolved here so that a message names that one file.
SCHEMA = Path(str(files("stagereplay.resources") / "config.schema.yaml")).resolve()


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
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
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


def config_layers(paths: list[str | Path], entries: list[str] | tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """What ``snakemake --configfile PATHS --config ENTRIES`` reads, layer by layer, with snakemake's own
    readers: each file (named as given), then the ``--config`` entries (typed as snakemake types them)."""
    from snakemake.common.configfile import load_configfile
    from snakemake_interface_common.exceptions import WorkflowError

    layers = []
    for path in paths:
        try:
            layers.append((str(path), load_configfile(path)))
        except OSError as error:
            raise ConfigError(
                f"config file {path} not readable ({error.strerror}) — give a config file's path"
            ) from None
        except WorkflowError as error:
            raise ConfigError(f"config file {path}: {error} — give a YAML file of config keys") from None
    if entries:
        from snakemake.cli import parse_config  # snakemake's whole command line: imported only when needed

        try:
            layers.append(("--config", parse_config(list(entries))))
        except ValueError as error:
            raise ConfigError(f"--config: {error} — give KEY=VALUE") from None
    return layers


def effective_config(layers: list[tuple[str, dict]]) -> dict:
    """The layers merged as snakemake merges them (snakemake.utils.update_config, later over earlier), checked
    and completed with the schema's defaults: the config the workflow runs."""
    from snakemake.utils import update_config

    config: dict = {}
    for _, layer in layers:
        update_config(config, copy.deepcopy(layer))
    return resolve_config(config)


def value_sources(config: dict, layers: list[tuple[str, dict]]) -> dict[tuple[str, ...], str]:
    """Each leaf of the effective ``config`` (a key path) -> the name of the last layer that set it, or
    "schema" where no layer did (an empty mapping a layer gave is a leaf of that layer)."""
    set_by = {}
    for name, layer in layers:
        for path in _leaf_paths(layer):
            set_by[path] = name
    return {path: set_by.get(path, "schema") for path in _leaf_paths(config)}


def _leaf_paths(mapping: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, (*prefix, str(key)))
        else:
            paths.append((*prefix, str(key)))
    return paths


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    """A config file, with ``overrides`` on top, as ``snakemake --configfile PATH`` resolves it."""
    return effective_config(config_layers([path]) + ([("overrides", overrides)] if overrides else []))


def render_config(config: dict, sources: dict[tuple[str, ...], str], schema_path: str | Path = SCHEMA) -> str:
    """The effective config as YAML that reads back to it, keys in the schema's order (a name-keyed mapping such
    as checkpoints in its own), each leaf followed by a comment naming its source."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    lines: list[tuple[str, str | None]] = []

    def walk(mapping: dict, subschema: dict, prefix: tuple[str, ...], indent: str) -> None:
        properties = subschema.get("properties", {})
        keys = [key for key in properties if key in mapping] + [key for key in mapping if key not in properties]
        for key in keys:
            value, path = mapping[key], (*prefix, str(key))
            child = properties.get(key) or subschema.get("additionalProperties") or {}
            if isinstance(value, dict) and value:
                lines.append((f"{indent}{_flow(key)}:", None))
                walk(value, child if isinstance(child, dict) else {}, path, indent + "  ")
            else:
                lines.append((f"{indent}{_flow(key)}: {_flow(value)}", sources[path]))

    walk(config, schema, (), "")
    column = min(max(len(text) for text, _ in lines), 64) + 2
    return "\n".join(text if source is None else f"{text.ljust(column - 2)}  # {source}" for text, source in lines)


def _flow(value) -> str:
    """One value in YAML's flow style, on one line (a mapping or list inline, a string quoted where YAML needs)."""
    return yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()[1:-1]
