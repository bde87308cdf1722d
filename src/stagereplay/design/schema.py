"""Check a workflow config against its JSON schema with one readable line per problem."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml


def config_problem(config: dict, schema_path: str | Path) -> str | None:
    """The most relevant schema violation as one line, or None when the config is valid."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is None:
        return None
    key = ".".join(str(part) for part in error.absolute_path) or "(top level)"
    return f"config key {key}: {error.message} — fix it in your config file (allowed keys and values: {schema_path})"
