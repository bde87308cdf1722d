"""A resolved config checked before any job runs, and what the workflow derives from it: one call.

``plan_run`` is what the workflow (``common.smk``) runs when it parses a config and what
``stagereplay plan`` runs before it projects one: the items, the checkpoints' sources and engines,
every precision against the engine that runs it, the runtime switches, E2's constructions, E5's plan
and E6's levels. Any problem is one line (``RunRefused``) naming the config key and the fix, raised
before anything is written. No torch: it reads the config, the item file and the model's config.json.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from stagereplay.design.attach import AttachRefused, check_attached
from stagereplay.design.factors import FactorError, Level, check_levels
from stagereplay.design.jobs import JobList, job_list, outcome_blind_checkpoint
from stagereplay.design.served import ServedRefused, check_served, served_tokens
from stagereplay.engines.cpuinfo import cpu_flags
from stagereplay.engines.registry import SPECS, spec_for_record
from stagereplay.engines.spec import EngineSpec, ModelError, SpecError
from stagereplay.ledger.layout import LedgerLayout

# Where a checkpoint comes from: exactly one of these keys in its config entry.
SOURCES = ("embedded", "folder", "gguf", "random_qwen2")


class RunRefused(ValueError):
    """One line: what in the config cannot run, and the fix."""


@dataclass
class RunPlan:
    """A config that passed every parse-time check, and what the workflow's rules are planned from."""

    config: dict
    repo: Path
    layout: LedgerLayout
    items: list
    shards: list[str]
    constructions: list[str]
    jobs: JobList
    blind_ids: list[str]
    prompt_lengths: list[int]
    max_positions: int
    factor_levels: list[Level]
    engines: dict[str, EngineSpec] = field(default_factory=dict)  # checkpoint -> its engine's spec
    served_servers: list[str] = field(default_factory=list)  # the served block's servers, the reference first

    @property
    def primary(self) -> str:
        return next(iter(self.config["checkpoints"]))

    def spec(self, checkpoint: str) -> EngineSpec:
        return self.engines[checkpoint]

    def model_folder(self, checkpoint: str) -> str:
        return model_folder(self.config, self.repo, self.layout, checkpoint)

    def repo_path(self, path: str | Path) -> str:
        """A config path, relative to the repository, not to where snakemake was started."""
        return repo_path(self.repo, path)

    def checkpoint_source(self, checkpoint: str) -> str:
        return checkpoint_source(self.config, self.repo, checkpoint)

    def gguf_path(self, checkpoint: str) -> str:
        """The GGUF a checkpoint runs: its configured file, or the embedded default's, once extracted."""
        entry = self.config["checkpoints"][checkpoint]
        return self.repo_path(entry["gguf"]) if "gguf" in entry else self.layout.embedded_gguf

    def gguf_sha256(self, checkpoint: str) -> str:
        """The sha256 a GGUF must have: the configured one, the embedded default's, or "" (none given)."""
        entry = self.config["checkpoints"][checkpoint]
        return entry.get("sha256") or ("" if "gguf" in entry else self.config["embedded_model"]["sha256"])

    def attach_option(self, checkpoint: str, recorded: str | None = None) -> str:
        """register-model's --attach: the server an attached checkpoint runs on, its slot folder as seen here;
        ``recorded``: the ledger's model record, whose server it must be (the audit's registration)."""
        attach = self.config["checkpoints"][checkpoint].get("attach")
        if not attach:
            return ""
        attach = {**attach, "slot_dir": str(Path(self.repo_path(attach["slot_dir"])).resolve())}
        option = "--attach " + shlex.quote(json.dumps(attach, sort_keys=True))
        return option + (f" --recorded {shlex.quote(recorded)}" if recorded else "")

    def registered_inputs(self, checkpoint: str) -> str | list[str]:
        """What registering a checkpoint reads: its model folder or GGUF; of a user's safetensors folder, which
        is not ours to track as a directory, its config and weight files."""
        folder = self.model_folder(checkpoint)
        if self.checkpoint_source(checkpoint) == "folder" and self.spec(checkpoint).record_kind == "folder":
            return sorted(str(path) for path in Path(folder).glob("*") if path.suffix in (".json", ".safetensors"))
        return folder

    @property
    def audit_inputs(self) -> list[str]:
        """What the audit's comparison reads: the saved tables and model records, and the audit tree's."""
        saved = [self.layout.table("trajectories"), self.layout.table("comparisons")]
        saved += [self.layout.model_record(name) for name in self.audited_checkpoints]
        if self.config["transplant"]["enabled"]:
            saved += [self.layout.table("transplants"), self.layout.selection]
        if self.factor_levels:
            saved.append(self.layout.table("factors"))
        if self.served_servers:
            saved.append(self.layout.table("served"))
        return saved + [self.layout.audited(path) for path in saved]

    @property
    def served_tokens(self) -> int:
        """Greedy tokens per served request."""
        return served_tokens(self.config)

    @property
    def blind_checkpoint(self) -> str:
        """The outcome-blind replication's checkpoint (E5): the one configured, else the primary."""
        return outcome_blind_checkpoint(self.config)

    @property
    def used_checkpoints(self) -> list[str]:
        """The checkpoints the run uses (a configured but unused checkpoint is never registered)."""
        blind = {self.blind_checkpoint} if self.config["transplant"]["enabled"] else set()
        return sorted({self.primary} | blind)

    @property
    def audited_checkpoints(self) -> list[str]:
        """The model records the audit compares (the outcome-blind checkpoint's even without E5)."""
        return sorted({self.primary, self.blind_checkpoint})

    @property
    def compared_checkpoints(self) -> list[str]:
        """The checkpoints whose trajectories are compared: the primary and the outcome-blind replication's."""
        return sorted({self.primary, *self.jobs.replications})

    @property
    def audit_runtime(self) -> dict:
        """The audit's runtime: the run's, with what the audit block sets in its place."""
        given = self.config["audit"]["runtime"]
        return {**self.config["runtime"], **{key: value for key, value in given.items() if value is not None}}

    @property
    def audit_store_caches(self) -> str:
        """The audit stores none of its recomputed caches unless audit.keep_caches asks it to."""
        return "all" if self.config["audit"]["keep_caches"] else "none"

    def model_resources(self, runtime: dict) -> dict:
        """A model job's resources at ``runtime``: memory, time, a GPU and the device memory it expects."""
        return {
            "mem_mb": self.config["runtime"]["mem_mb"],
            "runtime": self.config["runtime"]["runtime_minutes"],
            "gpu": 1 if runtime["device"] == "cuda" else 0,
            "gpu_mem_mb": self.device_memory_mb(runtime, self.compared_checkpoints),
        }

    def device_memory_mb(self, runtime: dict, compared: list[str]):
        """A model job's expected device memory in MiB as a function of its wildcards (the resource gpu_mem_mb,
        from ``engines.shapes.job_memory_bytes``: weights at the precision, caches, activations), so the profiles
        run as many model jobs per GPU as fit. 0 on the CPU, and for a GGUF not converted yet (its shapes are
        unknown until then). A job without a checkpoint wildcard (compare, rebuilding caches that are not stored:
        one model at a time, of any of the ``compared`` checkpoints and precisions) declares the largest."""
        from stagereplay.engines.shapes import checkpoint_shapes, job_memory_bytes

        checkpoints = self.config["checkpoints"]
        precisions = {self.config["matched"]["precision"], *self.config["fixed_prefix"]["precisions"]}

        def job_mb(checkpoint: str, precision: str) -> int:
            shapes = checkpoint_shapes(checkpoints[checkpoint], self.model_folder(checkpoint))
            return job_memory_bytes(shapes, precision, self.max_positions) // 2**20 if shapes else 0

        def gpu_mem_mb(wildcards) -> int:
            if runtime["device"] == "cpu":
                return 0
            if hasattr(wildcards, "checkpoint"):
                return job_mb(wildcards.checkpoint, wildcards.precision)
            return max(job_mb(name, precision) for name in compared for precision in precisions)

        return gpu_mem_mb


# The checkout this code runs from, when it does (an installed copy has none).
SOURCE_TREE = Path(__file__).resolve().parents[3]


def default_repo() -> Path:
    """What config paths are relative to outside snakemake (``stagereplay plan``): the checkout this code runs
    from, or, for an installed package, which has none, the working directory."""
    return SOURCE_TREE if (SOURCE_TREE / "Snakefile").is_file() else Path.cwd()


def repo_path(repo: Path, path: str | Path) -> str:
    """Config paths are relative to the repository, not to where snakemake was started."""
    path = Path(path).expanduser()
    return str(path if path.is_absolute() else repo / path)


def checkpoint_source(config: dict, repo: Path, name: str) -> str:
    spec = config["checkpoints"][name]
    given = [key for key in SOURCES if key in spec]
    if len(given) != 1:
        raise RunRefused(
            f"checkpoint {name!r} must name exactly one source of {', '.join(SOURCES)} (got {given or 'none'}) — fix checkpoints.{name}"
        )
    if "sha256" in spec and given[0] != "gguf":
        raise RunRefused(f"checkpoint {name!r}: sha256 applies only to a gguf source — remove it or use gguf:")
    source = given[0]
    if source in ("folder", "gguf") and not Path(repo_path(repo, spec[source])).exists():
        raise RunRefused(
            f"checkpoint {name!r}: {source} {repo_path(repo, spec[source])} does not exist — fix checkpoints.{name}.{source}"
        )
    if source == "folder" and not Path(repo_path(repo, spec["folder"]), "config.json").is_file():
        raise RunRefused(
            f"checkpoint {name!r}: {repo_path(repo, spec['folder'])} has no config.json — point checkpoints.{name}.folder at a Hugging Face model folder"
        )
    return source


def engine_spec(config: dict, repo: Path, name: str) -> EngineSpec:
    """The spec of the engine that runs a checkpoint, its source checked against it."""
    try:
        spec = spec_for_record(config["checkpoints"][name])
    except ModelError as error:
        raise RunRefused(f"checkpoints.{name}.engine: {error}") from None
    try:
        spec.check_source(name, checkpoint_source(config, repo, name))
    except SpecError as error:
        raise RunRefused(str(error)) from None
    return spec


def model_folder(config: dict, repo: Path, layout: LedgerLayout, name: str) -> str:
    """What register_model fingerprints: a safetensors folder, or the GGUF itself for an engine that runs one."""
    source = checkpoint_source(config, repo, name)
    entry = config["checkpoints"][name]
    if engine_spec(config, repo, name).record_kind == "gguf":
        if source == "random_qwen2":
            return layout.random_gguf(name)
        return repo_path(repo, entry["gguf"]) if source == "gguf" else layout.embedded_gguf
    if source == "folder":
        return repo_path(repo, entry["folder"])
    if source == "random_qwen2":
        return layout.random_model(name)
    return layout.converted_model(name)


def check_precisions(config: dict, repo: Path) -> None:
    """Every checkpoint's precisions against its engine, before any job runs (E1, E2's, E5's cast), and the
    runtime switches against the engines that run."""
    checkpoints, runtime, transplant = config["checkpoints"], config["runtime"], config["transplant"]
    primary = next(iter(checkpoints))
    e1 = config["matched"]["precision"]
    cross = transplant["cross_precision"] if transplant["enabled"] else None
    blind = outcome_blind_checkpoint(config)
    asked = {primary: {e1, *config["fixed_prefix"]["precisions"], *([cross] if cross else [])}}
    asked.setdefault(blind, set()).add(e1)
    try:
        for name, precisions in asked.items():
            if name not in checkpoints:  # an unknown outcome-blind checkpoint: the transplant check names it
                continue
            spec = engine_spec(config, repo, name)
            spec.check_run(name, precisions, runtime)
            if name == primary and cross:
                spec.check_cast(e1, cross)
        for name in asked:
            if name in checkpoints:
                engine_spec(config, repo, name).check_switches(runtime)
    except SpecError as error:
        raise RunRefused(str(error)) from None


def check_audited_models(config: dict, repo: Path, layout: LedgerLayout) -> None:
    """The audit reruns the models the ledger names: a missing one is refused before any job."""
    primary = next(iter(config["checkpoints"]))
    blind = outcome_blind_checkpoint(config)
    for name in sorted({primary, blind}):
        path = Path(model_folder(config, repo, layout, name))
        if not path.exists():
            raise RunRefused(
                f"audit: the model of checkpoint {name!r} is missing ({path}) — restore it where the run had it,"
                " or point the checkpoint at it, and audit again"
            )


def check_items(config: dict, repo: Path, layout: LedgerLayout, auditing: bool) -> list:
    """The items (ids are known at parse time, no checkpoints): a bad item file fails here."""
    from stagereplay.inputs.items import ItemError, load_items

    spec = config["items"]
    try:
        if auditing:  # the items the run used: the ledger's own copy (checked against provenance.json)
            return load_items(layout.items, "jsonl")
        return load_items(repo_path(repo, spec["source"]), spec["format"], spec["shuffle_seed"], spec["limit"])
    except ItemError as error:
        raise RunRefused(str(error)) from None


def check_constructions(config: dict) -> list[str]:
    """E2's construction names, so a typo fails before any job."""
    from stagereplay.design.names import ConstructionError, parse_construction

    names = config["fixed_prefix"]["constructions"]
    try:
        kinds = [parse_construction(name)[0] for name in names]
    except ConstructionError as error:
        raise RunRefused(f"fixed_prefix.constructions: {error}") from None
    if "live" in kinds:
        raise RunRefused(
            "fixed_prefix.constructions: live is generated, not rebuilt — list only incremental, prefill or chunked:N"
        )
    if "incremental" not in names:
        raise RunRefused(
            "fixed_prefix.constructions must include incremental (every E2 comparison is against it) — add it"
        )
    return names


def check_transplant_plan(config: dict, repo: Path, layout: LedgerLayout, items: list) -> list[str]:
    """E5's outcome-blind sample, and the sweep checked now when the model is known already (a folder, or
    converted by an earlier run), so a bad layer choice fails before any job and the ledger stays as it was."""
    from stagereplay.design.names import SweepPlan, TransplantError, check_plan, outcome_blind_sample

    checkpoints, transplant = config["checkpoints"], config["transplant"]
    primary = next(iter(checkpoints))
    blind, sweep = transplant["outcome_blind"], transplant["sweep"]
    blind_checkpoint = outcome_blind_checkpoint(config)
    if blind_checkpoint not in checkpoints:
        raise RunRefused(
            f"transplant.outcome_blind.checkpoint {blind_checkpoint!r} is not in checkpoints — add it there or fix the name"
        )
    cross = transplant["cross_precision"]
    if cross and cross == config["matched"]["precision"]:
        raise RunRefused("transplant.cross_precision must differ from matched.precision — use e.g. fp32 with a bf16 E1")
    try:
        blind_ids = outcome_blind_sample([item.item_id for item in items], blind["sample"], blind["seed"])
    except ValueError as error:
        raise RunRefused(str(error)) from None
    layers_file = Path(model_folder(config, repo, layout, primary), "config.json")
    if layers_file.is_file():
        plan = SweepPlan(sweep["single_layers"], tuple(sweep["block_sizes"]), sweep["kv_only"], tuple(sweep["windows"]))
        try:
            check_plan(plan, json.loads(layers_file.read_text()).get("num_hidden_layers", 0))
        except TransplantError as error:
            raise RunRefused(str(error)) from None
    return blind_ids


def prompt_lengths(config: dict, repo: Path, layout: LedgerLayout, items: list) -> list[int]:
    """Each item's prompt length, estimated from the items' text (the prompt tokens do not exist yet)."""
    from stagereplay.design.prompt_lengths import estimate_prompt_tokens
    from stagereplay.engines.shapes import checkpoint_shapes

    primary = next(iter(config["checkpoints"]))
    shapes = checkpoint_shapes(config["checkpoints"][primary], model_folder(config, repo, layout, primary))
    return estimate_prompt_tokens(items, shapes is not None and shapes.vocab <= 512)


def check_factor_levels(config: dict, repo: Path, layout: LedgerLayout, items: list, estimated: list[int]) -> list:
    """E6's levels (factor, level, engine, batch size against the items, a prefix-cache block against the
    shortest prompt, the CPU's kernel levels), each factor's control level among them."""
    from stagereplay.design.prompt_lengths import measured_prompt_tokens

    primary = next(iter(config["checkpoints"]))
    runtime = config["runtime"]
    prompts = measured_prompt_tokens(layout.prompts(primary)) or estimated
    try:
        return check_levels(
            config["factors"],
            engine_spec(config, repo, primary),
            len(items),
            min(prompts),
            cpu_flags(),
            runtime["device"],
            config["matched"]["precision"],
            runtime["flash_attn"],
            runtime,
            SPECS.values(),
        )
    except FactorError as error:
        raise RunRefused(str(error)) from None


def plan_run(config: dict, repo: str | Path, auditing: bool = False) -> RunPlan:
    """Every parse-time check of a resolved config (``design.schema.resolve_config``), in the order a user
    meets them; the first problem is raised as one line."""
    repo = Path(repo)
    layout = LedgerLayout(config["ledger_dir"])
    if layout.root.exists() and not layout.root.is_dir():
        raise RunRefused(
            f"ledger_dir {layout.root} is a file, not a directory — point ledger_dir at a directory (new or of an earlier run)"
        )
    items = check_items(config, repo, layout, auditing)
    shard_size = config["shard_size"]
    shards = [f"{index:03d}" for index in range((len(items) + shard_size - 1) // shard_size)]
    constructions = check_constructions(config)
    engines = {name: engine_spec(config, repo, name) for name in config["checkpoints"]}
    try:
        check_attached(config, engines)
    except AttachRefused as error:
        raise RunRefused(str(error)) from None
    check_precisions(config, repo)
    if auditing:
        check_audited_models(config, repo, layout)
    blind_ids = check_transplant_plan(config, repo, layout, items) if config["transplant"]["enabled"] else []
    lengths = prompt_lengths(config, repo, layout, items)
    stage = config["stage"]
    levels = check_factor_levels(config, repo, layout, items, lengths)
    try:
        served_servers = check_served(config, engines[next(iter(config["checkpoints"]))])
    except ServedRefused as error:
        raise RunRefused(str(error)) from None
    return RunPlan(
        config=config,
        repo=repo,
        layout=layout,
        items=items,
        shards=shards,
        constructions=constructions,
        jobs=job_list(config),
        blind_ids=blind_ids,
        prompt_lengths=lengths,
        # The longest sequence a model job holds: the longest prompt, the stage and the suffix.
        max_positions=max(lengths) + stage["max_new_tokens"] + stage["suffix_tokens"],
        factor_levels=levels,
        engines=engines,
        served_servers=served_servers,
    )
