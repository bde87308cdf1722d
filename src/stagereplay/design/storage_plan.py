"""How many bytes a run will store, and how much device memory a model job needs, before it runs.

Everything is projected from the model's shapes (layers, KV heads, head dim, the
dtype of each precision), the item count and the token budgets of the config:
which trajectories the enabled experiments record, which of their boundary
caches are distinct objects, and how many positions each holds. Figures that
depend on outcomes (a stage that stops early at EOS or the marker, a suffix
that ends at EOS, two constructions that happen to be bit-exact and share one
object, the number of divergent items E5 selects) are taken at their largest,
so those figures are upper bounds and say so. No torch: this runs when
snakemake parses the workflow and from `stagereplay plan`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from stagereplay.design.jobs import JobList, job_list, sweep_subsets
from stagereplay.design.prompt_lengths import estimate_prompt_tokens, measured_prompt_tokens
from stagereplay.design.run_plan import RunPlan, checkpoint_source, repo_path
from stagereplay.design.storage import DEFAULT, POLICIES, check_policy
from stagereplay.engines.shapes import (
    MODEL_CONFIGS,
    ModelShapes,
    PlanError,
    checkpoint_shapes,
    read_model_config,
    stored_part,
)

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1}
# An object's metadata holds a model fingerprint: 32 hex digits (xxh3-128).
_FINGERPRINT = "0" * 32


# --- bytes of one stored object ---------------------------------------------------------------


def _safetensors_bytes(tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str]) -> int:
    """Size of a safetensors file: 8-byte length, JSON header padded to 8 bytes, raw data."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    # safetensors lays tensors out widest dtype first, then by name: the order fixes each offset, and so
    # the header's length, where K and V differ in dtype (q8_0-fp16).
    for name, (dtype, shape) in sorted(tensors.items(), key=lambda item: (-_DTYPE_BYTES[item[1][0]], item[0])):
        size = math.prod(shape) * _DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"))
    return 8 + len(text) + (-len(text)) % 8 + offset


def cache_object_bytes(shapes: ModelShapes, precision: str, positions: int, rotation: bool = True) -> int:
    """A boundary cache object as ObjectStore.put writes it (ShardRecorder's metadata). ``rotation``: a
    quantized llama.cpp cache stored rotated (llama.cpp's default), which its tensor names say."""
    tensors = {}
    for part in ("k", "v"):
        suffix, dtype, width = stored_part(precision, part, shapes.head_dim, rotation)
        for layer in range(shapes.layers):
            tensors[f"layer.{layer:03d}.{part}{suffix}"] = (dtype, [1, shapes.kv_heads, positions, width])
    metadata = {
        "kind": "kv_cache",
        "positions": f"0:{positions}",
        "model_fingerprint": _FINGERPRINT,
        "precision": precision,
    }
    return _safetensors_bytes(tensors, metadata)


def token_object_bytes(count: int) -> int:
    """A token-list object as ObjectStore.put_tokens writes it (its metadata is only its kind)."""
    metadata = {"kind": "tokens"}
    return _safetensors_bytes({"tokens": ("I64", [count])}, metadata)


# --- what the config records ------------------------------------------------------------------


@dataclass(frozen=True)
class Design:
    """What a resolved config schedules (the job list, design.jobs) in the terms the byte counts need."""

    jobs: JobList
    replicas: int
    precisions: tuple[str, ...]
    max_new_tokens: int
    suffix_tokens: int
    transplant: bool
    first_k: int | None
    blind_sample: int
    cross: str | None
    sweep_subsets: int  # subsets tried per selected item and direction besides all layers
    store_caches: str = DEFAULT

    @classmethod
    def from_config(cls, config: dict, layers: int) -> Design:
        """From a config completed with the schema's defaults (design.schema.resolve_config)."""
        transplant = config["transplant"]
        return cls(
            jobs=job_list(config),
            replicas=config["matched"]["replicas"],
            precisions=tuple(config["fixed_prefix"]["precisions"]),
            max_new_tokens=config["stage"]["max_new_tokens"],
            suffix_tokens=config["stage"]["suffix_tokens"],
            transplant=transplant["enabled"],
            first_k=transplant["selected"]["first_k"],
            blind_sample=transplant["outcome_blind"]["sample"],
            cross=transplant["cross_precision"],
            sweep_subsets=sweep_subsets(transplant["sweep"], layers),
            store_caches=check_policy(config["store_caches"]),
        )

    @property
    def e1(self) -> str:
        return self.jobs.e1

    @property
    def blind_on_primary(self) -> bool:
        return not self.jobs.replications

    def trajectories(self) -> list[tuple[str, str, str, int]]:
        """(construction, precision, prefix precision, replica) of every trajectory row of one item
        on the primary checkpoint, from the job list."""
        return sorted(
            (t.construction, t.precision, t.prefix_precision, t.replica) for t in self.jobs.of(self.jobs.primary)
        )

    def replication_trajectories(self) -> list:
        """The trajectories of the checkpoints besides the primary one (the outcome-blind replication's)."""
        return [t for checkpoint in self.jobs.replications for t in self.jobs.of(checkpoint)]

    def cache_objects(self, shared_prefix: bool = False) -> list[tuple[str, str, str]]:
        """(construction, precision, prefix precision) of each distinct boundary cache of one item:
        replicas share their objects, and incremental over a live run's own prefix is that live cache
        (E3's claim, bit-exact), so they are one object. With ``shared_prefix`` every precision's live
        run reproduced the E1 prefix: its cache is then E2's incremental one at that precision. Every
        other pair is counted apart (two constructions that turn out bit-exact share one object)."""
        distinct = {
            ("live" if construction == "incremental" and precision == prefix else construction, precision, prefix)
            for construction, precision, prefix, _ in self.trajectories()
        }
        if shared_prefix:
            distinct -= {
                ("live", p, p) for p in self.precisions if p != self.e1 and ("incremental", p, self.e1) in distinct
            }
        return sorted(distinct)

    def transplants_per_item(self) -> dict[str, int]:
        """Transplant rows per item in each selection, from the job list's pairs (the sweep on selected)."""
        counts: dict[str, int] = {}
        for job in self.jobs.transplants:
            rows = len(job.pairs) * (1 + (self.sweep_subsets if job.sweep else 0))
            counts[job.selection] = counts.get(job.selection, 0) + rows
        return counts


def _positions(prompt: int, design: Design) -> int:
    """Positions of a boundary cache: the prefix less its pending last token, the stage at its budget."""
    return prompt + design.max_new_tokens - 1


@dataclass
class Projection:
    """Bytes by part and policy, with the shapes and counts they came from."""

    items: int
    prompt_tokens: list[int]
    prompt_measured: bool
    cache_bytes: dict[str, int] = field(default_factory=dict)  # by policy
    tokens_bytes: int = 0
    tables_bytes: int = 0
    documents_bytes: int = 0
    model_bytes: int = 0
    audit_bytes: int = 0
    audit_cache_copy_bytes: int = 0  # what an audit that stores its recomputed caches adds
    shared_prefix_cache_bytes: int = 0  # `all` caches when every precision's live run reproduces the E1 prefix
    cache_items: dict[str, int] = field(default_factory=dict)
    caches_per_item: int = 0
    kv_bytes_per_position: dict[str, int] = field(default_factory=dict)
    example_cache_bytes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def parts(self, policy: str) -> dict[str, int]:
        return {
            "caches": self.cache_bytes[policy],
            "tokens": self.tokens_bytes,
            "tables": self.tables_bytes,
            "documents": self.documents_bytes,
            "model": self.model_bytes,
        }

    def ledger_bytes(self, policy: str) -> int:
        return sum(self.parts(policy).values())


# Parquet: a file's schema, footer and row digest; a row's key, environment and scalar columns;
# per-layer fingerprints (32 hex digits, partly shared through dictionary pages) and token lists
# (compressed). Calibrated on ledgers of config/test.yaml (4-row shards) and of the 50-item
# rehearsal (25-row shards); small beside the caches of any real model.
_PARQUET_FILE_BYTES = 12_500
_ROW_BYTES = 40
_FINGERPRINT_BYTES = 16
_TOKEN_BYTES = 6  # a suffix token and its margin
_AUDIT_ROW_BYTES = 2  # a row of tables/audit.parquet: fingerprints that agree compress to almost nothing
# summary.json, the Markdown card, the five plots, and the self-contained HTML card, which holds
# the five plots again (base64, 4/3 of their bytes).
_DOCUMENTS_BYTES = 650_000
# A normalised items.jsonl row, and the item's entry in the HTML card's per-item view (its suffixes,
# labels, transplant outcomes and an inline per-layer plot where the caches differ).
_ITEM_BYTES = 240 + 25_000
_TOKENIZER_BYTES_PER_ENTRY = 45  # tokenizer.json (vocabulary and merges) in a converted folder


def project(
    config: dict,
    shapes: ModelShapes,
    prompt_tokens: list[int],
    prompt_measured: bool,
    model_in_ledger: bool = False,
    replication_shapes: ModelShapes | None = None,
    shared_prefix_items: Collection[int] = (),
) -> Projection:
    """The ledger and audit bytes of ``config`` run on a model of ``shapes`` over these prompts.

    ``model_in_ledger``: the checkpoint is converted or built into the ledger (embedded, GGUF,
    random), as an fp32 safetensors folder with its tokenizer; a user's folder stays where it is.
    ``shared_prefix_items``: on these items (indices), each other precision's live run
    reproduces the E1 prefix, so its cache is E2's incremental cache at that precision (one object).
    Short stages on a small model do that; it cannot be known before the run, so the plan prints
    both ends (none, the upper bound, and every item).
    """
    design = Design.from_config(config, shapes.layers)
    items = len(prompt_tokens)
    shards = math.ceil(items / config["shard_size"])
    result = Projection(items, prompt_tokens, prompt_measured)
    caches = design.cache_objects()
    result.caches_per_item = len(caches)
    shared = design.cache_objects(shared_prefix=True)
    per_item = [
        sum(
            cache_object_bytes(shapes, precision, _positions(p, design))
            for _, precision, _ in (shared if index in shared_prefix_items else caches)
        )
        for index, p in enumerate(prompt_tokens)
    ]
    # The outcome-blind replication on another checkpoint: its trajectories in the job list (E1 live and prefill).
    replicated = design.replication_trajectories()
    other = (replication_shapes or shapes) if replicated else None
    other_per_item = [
        sum(cache_object_bytes(other, t.precision, _positions(p, design)) for t in replicated) for p in prompt_tokens
    ]
    all_bytes = sum(per_item) + sum(other_per_item)
    # `selected`: only the caches the transplant jobs read (the job list's transplant pairs, design.jobs): E1 live and
    # prefill of E5's selected first_k items and of the outcome-blind sample, and on the selected items
    # also the cross-precision recipients (incremental and prefill at that precision over the E1 prefix).
    # Which items diverge is known only after E1, so the largest items stand in for them.
    selected = min(items, (design.first_k or items) + (design.blind_sample if design.blind_on_primary else 0))
    selected = selected if design.transplant else 0
    chosen = min(items, design.first_k or items) if design.transplant else 0

    def read_by_transplants(p: int, cross: bool) -> int:
        positions = _positions(p, design)
        e1_pair = 2 * cache_object_bytes(shapes, design.e1, positions)
        return e1_pair + (2 * cache_object_bytes(shapes, design.cross, positions) if cross and design.cross else 0)

    by_size = sorted(prompt_tokens, reverse=True)
    largest = [read_by_transplants(p, index < chosen) for index, p in enumerate(by_size[:selected])]
    blind_other = sorted(other_per_item, reverse=True)[: design.blind_sample] if other else []
    result.cache_bytes = {"all": all_bytes, "selected": sum(largest) + sum(blind_other), "none": 0}
    result.cache_items = {"all": items, "selected": selected, "none": 0}

    # Tokens: one prefix object per live run (the E1 prefix and each other precision's own), one suffix
    # object per distinct trajectory (replicas share theirs) and per transplant continuation.
    prefixes = len({prefix for _, _, prefix in caches})
    own_prefixes = [len(shared) if index in shared_prefix_items else len(caches) for index in range(items)]
    transplants = design.transplants_per_item()
    chosen = min(items, design.first_k or items)
    transplant_rows = chosen * (transplants.get("selected", 0) + transplants.get("cross_precision", 0))
    transplant_rows += min(items, design.blind_sample) * transplants.get("outcome_blind", 0)
    stage = design.max_new_tokens
    suffix_object = token_object_bytes(design.suffix_tokens)
    result.tokens_bytes = sum(
        (prefixes if count == len(caches) else 1) * token_object_bytes(p + stage) + count * suffix_object
        for p, count in zip(prompt_tokens, own_prefixes)
    )
    result.tokens_bytes += transplant_rows * suffix_object
    if replicated:  # its live prefix, and a suffix per trajectory
        result.tokens_bytes += sum(
            token_object_bytes(p + stage) + len(replicated) * suffix_object for p in prompt_tokens
        )

    # Tables: every trajectory and transplant row twice (its shard table and the gathered table),
    # one comparison row per compared pair, the prompt tokens.
    jobs = len(design.jobs.trajectories)
    rows = items * jobs
    fingerprints = 2 * shapes.layers * _FINGERPRINT_BYTES
    trajectory_row = _ROW_BYTES + fingerprints + _TOKEN_BYTES * design.suffix_tokens
    transplant_row = _ROW_BYTES + fingerprints // 4 + _TOKEN_BYTES * design.suffix_tokens // 2
    comparison_row = _ROW_BYTES + 2 * shapes.layers
    files = shards * (jobs + len(design.jobs.transplants)) + 4
    result.tables_bytes = (
        files * _PARQUET_FILE_BYTES
        + 2 * rows * trajectory_row
        + 2 * transplant_rows * transplant_row
        + rows * comparison_row
        + sum(prompt_tokens) * 8
    )
    result.documents_bytes = _DOCUMENTS_BYTES + items * _ITEM_BYTES
    if model_in_ledger:
        result.model_bytes = 4 * shapes.parameters() + _TOKENIZER_BYTES_PER_ENTRY * shapes.vocab

    # The audit recomputes every row into its own tree: prefix and suffix tokens and its shard and
    # gathered tables again, plus its audit table (a row per compared fingerprint); no cache tensors.
    # An audit that kept its recomputed caches would add a second copy of the `all` caches.
    audit_rows = rows * (4 + 2 * shapes.layers) + transplant_rows * (3 + 2 * shapes.layers)
    result.audit_bytes = (
        result.tokens_bytes + result.tables_bytes - sum(prompt_tokens) * 8 + audit_rows * _AUDIT_ROW_BYTES
    )
    result.audit_cache_copy_bytes = all_bytes
    result.shared_prefix_cache_bytes = sum(other_per_item) + sum(
        cache_object_bytes(shapes, precision, _positions(p, design))
        for p in prompt_tokens
        for _, precision, _ in shared
    )

    precisions = sorted({design.e1, *design.precisions})
    result.kv_bytes_per_position = {p: shapes.kv_bytes_per_position(p) for p in precisions}
    longest = max(prompt_tokens, default=0) + stage - 1
    result.example_cache_bytes = {p: cache_object_bytes(shapes, p, longest) for p in precisions}
    result.notes.append(
        f"{len(caches)} distinct caches per item: "
        + ", ".join(f"{c} {p}" if p == x else f"{c} {p} over the {x} prefix" for c, p, x in caches)
        + " (counted per construction; replicas and incremental share their live run's object)"
    )
    if len(shared) < len(caches):
        result.notes.append(
            f"where every other precision's live run reproduces the E1 prefix (short stages, small models) its cache is"
            f" E2's incremental one: {len(shared)} caches per item, {human(result.shared_prefix_cache_bytes)} at `all`"
        )
    result.notes.append(
        "caches, tokens and the audit are upper bounds: every stage runs to max_new_tokens and every suffix to"
        " suffix_tokens (EOS or the marker end them early), every construction pair is a distinct object"
        " (a bit-exact pair shares one); tables, documents and the model folder are estimates"
    )
    if design.transplant:
        result.notes.append(
            f"selected: caches of at most {selected} items (E5's first_k={design.first_k or 'all'} divergent items"
            f" and the outcome-blind sample of {design.blind_sample}; the cross-precision items are the selected ones),"
            " each with the caches its transplants read (E1 live and prefill; on the selected items also the"
            " cross-precision incremental and prefill); which items diverge is known only after E1"
        )
    if not prompt_measured:
        result.notes.append("prompt lengths estimated from the items' characters (a run's prompt table measures them)")
    return result


# --- a config file's projection --------------------------------------------------------------------


def project_run(run: RunPlan, model_config: str | Path | None = None) -> tuple[Projection, ModelShapes, str]:
    """The projection of a checked run (design.run_plan.plan_run): the primary checkpoint's shapes
    (``model_config`` or, for the embedded and random checkpoints and any folder, from the config itself),
    its items and, when the ledger holds them already, the run's measured prompt lengths."""
    config, name = run.config, run.jobs.primary
    spec = config["checkpoints"][name]
    source = checkpoint_source(config, run.repo, name)
    if model_config is not None:
        shapes, described = read_model_config(model_config)
        name = Path(described).stem if Path(described).parent == MODEL_CONFIGS else described
    else:
        folder = repo_path(run.repo, spec["folder"]) if source == "folder" else run.layout.converted_model(name)
        shapes = checkpoint_shapes(spec, folder)
        if shapes is None:
            raise PlanError(
                f"checkpoint {name!r} is a GGUF not converted yet: its shapes are unknown — give --model-config path/to/config.json"
            )
        described = {"embedded": "the embedded SmolLM2-135M-Instruct", "random_qwen2": "a random Qwen2"}.get(
            source, f"{source} {spec.get(source)}"
        )
    measured = measured_prompt_tokens(run.layout.prompts(run.jobs.primary))
    if measured is not None and len(measured) != len(run.items):
        measured = None  # a ledger of another item set
    prompts = measured if measured is not None else estimate_prompt_tokens(run.items, byte_level=shapes.vocab <= 512)
    # Given a model config, the model is the user's own folder (as config/paper.yaml says to set it),
    # outside the ledger, unless the checkpoint is a GGUF, which is converted into the ledger.
    in_ledger = source == "gguf" or (source != "folder" and model_config is None)
    projection = project(config, shapes, prompts, measured is not None, model_in_ledger=in_ledger)
    return projection, shapes, name if model_config is not None else f"{name} ({described})"


# --- text -------------------------------------------------------------------------------------------


def human(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def render(projection: Projection, model: str, shapes: ModelShapes) -> str:
    lines = [
        f"model {model}: {shapes.layers} layers, {shapes.kv_heads} KV heads, head dim {shapes.head_dim},"
        f" {shapes.parameters() / 1e9:.3f}B parameters",
        "KV per position: "
        + ", ".join(f"{p} {human(b)}" for p, b in projection.kv_bytes_per_position.items())
        + "; one cache at the longest boundary: "
        + ", ".join(f"{p} {human(b)}" for p, b in projection.example_cache_bytes.items()),
        f"items: {projection.items}; prompt tokens {min(projection.prompt_tokens, default=0)}-{max(projection.prompt_tokens, default=0)}"
        f" ({'measured' if projection.prompt_measured else 'estimated'})",
        "",
        "| store_caches | items with caches | caches | tokens | tables | documents | model folder | ledger | audit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in POLICIES:
        lines.append(
            f"| {policy} | {projection.cache_items[policy]} | {human(projection.cache_bytes[policy])}"
            f" | {human(projection.tokens_bytes)} | {human(projection.tables_bytes)} | {human(projection.documents_bytes)}"
            f" | {human(projection.model_bytes)}"
            f" | {human(projection.ledger_bytes(policy))} | {human(projection.audit_bytes)} |"
        )
    lines.append("")
    lines.append(
        f"the audit stores no cache tensors; one that kept its recomputed caches would add {human(projection.audit_cache_copy_bytes)}"
    )
    lines.extend(f"note: {note}" for note in projection.notes)
    return "\n".join(lines)
