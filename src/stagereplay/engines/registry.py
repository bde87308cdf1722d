"""Every engine stagereplay runs, by name: the one place that lists them (no torch).

A model record names its engine (``engine``; absent means the default, transformers). Everything that
must know what an engine takes asks its ``EngineSpec`` here (``spec_for_record``, ``spec_named``); a model job
loads the engine itself through ``load_checkpoint``, which imports the engine's module only then; the
prompts job asks ``checkpoint_tokenizer`` for the tokenizer alone.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points

from stagereplay.engines.llamacpp.spec import LLAMACPP, LLAMASERVER
from stagereplay.engines.spec import EngineSpec, ModelError, SpecError
from stagereplay.engines.transformers.spec import TRANSFORMERS

# Engines from other distributions: each an entry point of this group naming its spec ("module:SPEC"), as
# vLLM's plugins register. A new engine is its own folder (or package) and this one line of its metadata.
ENTRY_POINT_GROUP = "stagereplay.engines"


def _plugged_in() -> tuple[EngineSpec, ...]:
    specs = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        spec = entry.load()
        if not isinstance(spec, EngineSpec):
            raise SpecError(
                f"entry point {entry.name} ({entry.value}) is no EngineSpec — point it at the engine's spec"
            )
        specs.append(spec)
    return tuple(specs)


SPECS: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> None:
    """Add an engine: its spec under its name (a name taken is refused in one line)."""
    if spec.name in SPECS:
        raise SpecError(f"engine {spec.name!r} is registered twice — give the new engine a name of its own")
    SPECS[spec.name] = spec


for _spec in (TRANSFORMERS, LLAMACPP, LLAMASERVER, *_plugged_in()):
    register(_spec)
DEFAULT_ENGINE = TRANSFORMERS.name
ENGINES = tuple(SPECS)
# Every precision some engine takes, as one regular expression (the workflow's precision wildcard).
PRECISION_PATTERN = "|".join(f"(?:{spec.precision_pattern})" for spec in SPECS.values())


# The libraries whose versions decide what some engine computes, in the registry's order (provenance).
ENGINE_LIBRARIES = tuple(dict.fromkeys(library for spec in SPECS.values() for library in spec.libraries))


def record_with_engine(record: dict) -> dict:
    """A model record with its engine named (a record without one is the default engine's)."""
    return {**record, "engine": engine_of_record(record)}


def spec_named(name: str) -> EngineSpec:
    if name not in SPECS:
        raise ModelError(f"unknown engine {name!r} — use one of {', '.join(SPECS)}")
    return SPECS[name]


def engine_of_record(record: dict) -> str:
    """The engine a model record or a checkpoint's config entry names (the default where none)."""
    return record.get("engine", DEFAULT_ENGINE)


def spec_for_record(record: dict) -> EngineSpec:
    """The spec of the engine a model record or a checkpoint's config entry names."""
    return spec_named(engine_of_record(record))


def any_precision(precision: str) -> bool:
    return re.fullmatch(PRECISION_PATTERN, precision) is not None


def precision_spec(precision: str) -> EngineSpec:
    """The first engine that takes ``precision``: a precision name two engines share (fp16, fp32) holds the
    same bytes in both. A name none takes is refused with the last engine's reason."""
    for spec in SPECS.values():
        if spec.takes(precision):
            return spec
    refusal = None
    for spec in SPECS.values():
        try:
            spec.check_precision(precision, flash_attn=True)
        except SpecError as error:
            refusal = error
    raise refusal or SpecError(f"precision {precision!r} is taken by no engine")


def serving_spec() -> EngineSpec:
    """The engine whose servers take whole requests (the config's ``served`` servers, ``stagereplay probe``)."""
    for spec in SPECS.values():
        if spec.server_module:
            return spec
    raise ModelError("no engine here serves whole requests — install one that does (see docs/engines.md)")


def spec_for_loaded_engine(engine: object) -> EngineSpec:
    """The spec of a loaded engine: the one whose ``engine_class_path`` names the engine's class, or the class it
    is a variant of (a llama-server attached at a URL is the llamaserver engine's)."""
    for cls in type(engine).__mro__:
        path = f"{cls.__module__}:{cls.__qualname__}"
        for spec in SPECS.values():
            if spec.engine_class_path == path:
                return spec
    path = f"{type(engine).__module__}:{type(engine).__qualname__}"
    raise ModelError(f"no registered engine runs {path} — register its spec (engines.registry.register)")


def engine_class(record: dict) -> type:
    """The engine that runs the record's checkpoint (its module is imported only when asked for)."""
    return spec_for_record(record).engine_class(attached="attach" in record)


def load_checkpoint(record: dict, runtime):
    """The record's checkpoint loaded at ``runtime`` (an ``engines.base.Engine``)."""
    return engine_class(record).load(record, runtime)


def checkpoint_tokenizer(record: dict, trust_remote_code: bool = False) -> tuple[object, int]:
    """The checkpoint's own tokenizer and the context a prompt must fit (0: unknown)."""
    return engine_class(record).checkpoint_tokenizer(record, trust_remote_code)
