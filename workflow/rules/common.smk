# Everything the rule files share (and nothing else) — the checked config, the ledger
# layout (stagereplay.ledger.layout), parse-time checks, and the input functions and path
# lists of every experiment. Rule files hold only rules and read only what is here.

import json
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from stagereplay.design import checked_run
from stagereplay.design.factors import FACTORS as FACTOR_NAMES
from stagereplay.design.factors import factor_named
from stagereplay.engines.registry import PRECISION_PATTERN
from stagereplay.engines.runtime import runtime_options
from stagereplay.ledger.layout import LedgerLayout, construction_of_token
from stagereplay.ledger.provenance import design_of

REPO = Path(workflow.basedir)
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def _audit_requested():
    """`snakemake audit` (or an audit rule as the target), or an audit job on a cluster node. The targets
    are not known while the Snakefile is parsed (snakemake sets them after), so they are read from the
    command line with snakemake's own parser; run any other way, the audit uses the config given."""
    from snakemake.cli import get_argument_parser

    try:
        args, _ = get_argument_parser().parse_known_args(sys.argv[1:])
    except SystemExit:
        return False
    names = {str(target) for target in args.targets or ()}
    names |= {spec.rulename for spec in args.target_jobs or ()}
    return any(name == "audit" or name.startswith("audit_") for name in names)


# The audit reruns the design recorded in the ledger (provenance.json), never the config on disk:
# a ledger handed over, or a config edited since the run, is audited as it was made.
AUDITING = _audit_requested()


def _take_recorded_design():
    from stagereplay.audit.design import AuditRefused, audit_config

    try:
        audited, note = audit_config(config)
    except AuditRefused as error:
        raise WorkflowError(str(error)) from None
    if note:
        print(note, file=sys.stderr)
    config.clear()
    config.update(audited)


if AUDITING:
    _take_recorded_design()


def _checked_run():
    """The config checked and completed with the schema's defaults, then every parse-time check
    (stagereplay.design.checked_run, which `stagereplay plan` runs too): a bad config, item file or
    model fails here, before any job, in one line."""
    from stagereplay.design.checked_run import RunRefused, check_run
    from stagereplay.design.schema import ConfigError, resolve_config

    try:
        resolve_config(config, SCHEMA)
        return check_run(config, REPO, AUDITING)
    except (ConfigError, RunRefused) as error:
        raise WorkflowError(str(error)) from None


RUN = _checked_run()

# Rules call the CLI as the command `stagereplay`: a shell function running it on the interpreter
# snakemake runs on, so rules work without an activated venv (and on a cluster node, which parses
# this file again). It comes after snakemake's own default prefix, bash strict mode.
shell.prefix(f'set -euo pipefail; stagereplay() {{{{ {shlex.quote(sys.executable)} -m stagereplay "$@"; }}}}; ')


def tail_log_on_failure(command, show_last_line=False):
    """Every job's shell command: on failure, the CLI's one-line error (the last line of the job's log) is
    repeated on the console; with ``show_last_line``, a job's one-line result is shown on success too.
    (A function, not a suffix string: `snakemake --lint` takes a string concatenated after a path-like
    string anywhere in a rule file for path composition.)"""
    tail = " || {{ tail -n 1 {log:q} >&2; exit 1; }}"
    return f"{command}{tail}; tail -n 1 {{log:q}}" if show_last_line else f"{command}{tail}"


LAYOUT = RUN.layout
# Under `snakemake audit`, each of the run's rules needs this file, which never exists; each saved file is then
# an input the audit reads, never a job it may rerun (after a copy that changed file times, a config edited
# since the run, a changed command). Snakemake refuses such a job before any job starts, naming this file.
AUDIT_GUARD = (
    [str(LAYOUT.root / "the-audit-never-reruns-the-saved-ledger--finish-the-run-with-a-plain-snakemake-first")]
    if AUDITING
    else []
)
CHECKPOINTS = config["checkpoints"]
PRIMARY = RUN.primary
RUNTIME = config["runtime"]
STAGE = config["stage"]
MATCHED = config["matched"]
E1 = MATCHED["precision"]
FIXED = config["fixed_prefix"]
TRANSPLANT = config["transplant"]
SWEEP = TRANSPLANT["sweep"]
BLIND = TRANSPLANT["outcome_blind"]
BLIND_CHECKPOINT = BLIND["checkpoint"] or PRIMARY
ITEMS_SPEC = config["items"]
# What the ledger records as the run's design (provenance.json; the audit reruns it).
DESIGN = design_of(config)
EMBEDDED_MODEL = config["embedded_model"]
AUDIT_RUNTIME = {
    **RUNTIME,
    **{key: value for key, value in config["audit"]["runtime"].items() if value is not None},
}
# Which cache tensors are stored (stagereplay.design.storage says what each policy keeps). The audit
# stores none of its recomputed caches unless audit.keep_caches asks it to.
STORE_CACHES = config["store_caches"]
AUDIT_STORE_CACHES = "all" if config["audit"]["keep_caches"] else "none"
# Every trajectory and transplant job the config schedules (the projection counts the same list).
JOBS = RUN.jobs
# Checkpoints other than the primary one: only the outcome-blind replication's, with E1 live and prefill (rep0).
REPLICATIONS = list(JOBS.replications)
# The checkpoints the run uses (a configured but unused checkpoint is never registered).
USED_CHECKPOINTS = sorted({PRIMARY} | ({BLIND_CHECKPOINT} if TRANSPLANT["enabled"] else set()))
# The model records the audit compares (as before: the outcome-blind checkpoint's even without E5).
AUDITED_CHECKPOINTS = sorted({PRIMARY, BLIND_CHECKPOINT})
SHARDS = RUN.shards
CONSTRUCTIONS = RUN.constructions
BLIND_IDS = RUN.blind_ids
# The longest sequence a model job holds: the longest prompt, the stage and the suffix.
MAX_POSITIONS = RUN.max_positions
FACTOR_LEVELS = RUN.factor_levels


def repo_path(path):
    """Config paths are relative to the repository, not to where snakemake was started."""
    return checked_run.repo_path(REPO, path)


def checkpoint_source(name):
    return checked_run.checkpoint_source(config, REPO, name)


def engine_name(name):
    return RUN.spec(name).name


def model_folder(name):
    """What register_model fingerprints: a safetensors folder, or the GGUF an engine runs as shipped."""
    return RUN.model_folder(name)


wildcard_constraints:
    checkpoint="[A-Za-z0-9][A-Za-z0-9._-]*",
    precision=PRECISION_PATTERN,
    prefix_precision=PRECISION_PATTERN,
    construction=r"incremental|prefill|chunked-[1-9][0-9]*",
    replica=r"\d+",
    shard=r"\d{3}",
    selection="selected|outcome_blind|cross_precision",
    factor="|".join(FACTOR_NAMES),
    level=r"[A-Za-z0-9_-]+",


# --- model jobs' arguments and resources ---------------------------------------------------------


def runtime_args(wildcards, replica=None, runtime=RUNTIME, store_caches=None):
    """A model job's command-line runtime (stagereplay.engines.runtime.runtime_options) and shard. The run's
    jobs are not told the store_caches policy (a job reads it from the ledger's storage.json when it stores),
    so a new policy reruns no job: the storage rule applies it (ledger.smk). The audit names its own
    (audit.keep_caches)."""
    args = [
        f"--checkpoint {wildcards.checkpoint}",
        f"--precision {wildcards.precision}",
        *runtime_options(runtime),
        f"--shard {int(wildcards.shard)}",
        f"--shard-size {config['shard_size']}",
        f"--replica {int(wildcards.replica) if replica is None else replica}",
        f"--suffix-tokens {STAGE['suffix_tokens']}",
        f"--max-positions {MAX_POSITIONS}",
    ]
    if runtime["device_memory_gb"]:
        args.append(f"--device-memory-gb {runtime['device_memory_gb']}")
    if store_caches is not None:
        args.append(f"--store-caches {store_caches}")
    return " ".join(args)


def audit_runtime_args(wildcards, replica=None):
    return runtime_args(wildcards, replica, AUDIT_RUNTIME, AUDIT_STORE_CACHES)


def rebuild_args(ledger, runtime):
    """What compare needs to rebuild a cache that is not stored: every checkpoint's model record in ``ledger``
    (the saved one, or the audit tree's) and the runtime the rows were computed with."""
    args = [f"--model {name} {shlex.quote(ledger.model_record(name))}" for name in COMPARED_CHECKPOINTS]
    return " ".join(args + runtime_options(runtime))


# The checkpoints whose trajectories are compared.
COMPARED_CHECKPOINTS = sorted({PRIMARY, *REPLICATIONS})
# compare rebuilds caches that are not stored, so then it is a model job (a cluster job, not a local one):
# a resource, not a rerun trigger (its inputs and command are the same at every policy).
COMPARE_REBUILDS = STORE_CACHES != "all"
AUDIT_COMPARE_REBUILDS = AUDIT_STORE_CACHES != "all"


MODEL_RESOURCES = dict(
    mem_mb=RUNTIME["mem_mb"],
    runtime=RUNTIME["runtime_minutes"],
    gpu=1 if RUNTIME["device"] == "cuda" else 0,
    gpu_mem_mb=RUN.device_memory_mb(RUNTIME, COMPARED_CHECKPOINTS),
)
AUDIT_MODEL_RESOURCES = {
    **MODEL_RESOURCES,
    "gpu": 1 if AUDIT_RUNTIME["device"] == "cuda" else 0,
    "gpu_mem_mb": RUN.device_memory_mb(AUDIT_RUNTIME, COMPARED_CHECKPOINTS),
}


# --- models (model.smk) --------------------------------------------------------------------------


def gguf_for(wildcards):
    spec = CHECKPOINTS[wildcards.checkpoint]
    return repo_path(spec["gguf"]) if "gguf" in spec else LAYOUT.embedded_gguf


def gguf_sha256(wildcards):
    spec = CHECKPOINTS[wildcards.checkpoint]
    return spec.get("sha256") or ("" if "gguf" in spec else EMBEDDED_MODEL["sha256"])


def registered_folder_input(wildcards):
    folder = model_folder(wildcards.checkpoint)
    if checkpoint_source(wildcards.checkpoint) == "folder" and RUN.spec(wildcards.checkpoint).record_kind == "folder":
        # A user folder is not ours to track as a directory; its config and weights are.
        return sorted(str(path) for path in Path(folder).glob("*") if path.suffix in (".json", ".safetensors"))
    return folder


# --- the job list (stagereplay.design.jobs) as shard tables ------------------------------------


def shard_table(ledger, trajectory, shard):
    return ledger.trajectory_table(*trajectory.fields(), shard)


def all_shard_tables():
    """Every trajectory table of the job list: E1, E2, E3 and the outcome-blind checkpoint's E1."""
    return sorted({shard_table(LAYOUT, trajectory, shard) for trajectory in JOBS.trajectories for shard in SHARDS})


# --- E5 (transplant.smk) -------------------------------------------------------------------------


def sweep_args():
    single = SWEEP["single_layers"]
    args = ["--sweep", f"--single-layers {','.join(map(str, single)) if isinstance(single, list) else single}"]
    if SWEEP["block_sizes"]:
        args.append("--block-sizes " + " ".join(map(str, SWEEP["block_sizes"])))
    if SWEEP["kv_only"]:
        args.append("--kv-only")
    if SWEEP["windows"]:
        args.append("--windows " + " ".join(map(str, SWEEP["windows"])))
    return " ".join(args)


def transplant_pairs(wildcards):
    """(donor, recipient) shard tables of one transplant job, in the order the job list gives."""
    job = JOBS.transplant(wildcards.selection, wildcards.checkpoint, wildcards.precision)
    return [tuple(shard_table(LAYOUT, side, wildcards.shard) for side in pair) for pair in job.pairs]


def transplant_inputs(wildcards):
    return sorted({path for pair in transplant_pairs(wildcards) for path in pair})


def transplant_pair_args(wildcards):
    return " ".join(f"--pair {donor} {recipient}" for donor, recipient in transplant_pairs(wildcards))


def transplant_tables():
    return [
        LAYOUT.transplant_table(job.selection, job.checkpoint, job.precision, shard)
        for job in JOBS.transplants
        for shard in SHARDS
    ]


def selection_inputs(ledger):
    """The E1 tables (rep0) select_transplants reads, in ``ledger`` or its audit tree."""
    live, prefill = JOBS.e1_pair(PRIMARY)
    return {
        "live": [shard_table(ledger, live, shard) for shard in SHARDS],
        "prefill": [shard_table(ledger, prefill, shard) for shard in SHARDS],
    }


# --- E6 (factors.smk) ---------------------------------------------------------------------------


def factor_references():
    """Every shard of E2's prefill rows (replica 0) at the E1 precision: where each E6 item starts."""
    _, prefill = JOBS.e1_pair(PRIMARY)
    return [shard_table(LAYOUT, prefill, shard) for shard in SHARDS]


def factor_tables(ledger=None):
    ledger = ledger or LAYOUT
    return [
        ledger.factor_table(PRIMARY, E1, level.factor, level.name, shard) for level in FACTOR_LEVELS for shard in SHARDS
    ]


def factor_threads(wildcards):
    """The threads a factor job declares: the run's, unless its level runs more (the factor's own answer)."""
    return factor_named(wildcards.factor).threads(wildcards.level, RUNTIME["threads"])


# --- E4 (audit.smk) ------------------------------------------------------------------------------


def audit_inputs():
    saved = [LAYOUT.table("trajectories"), LAYOUT.table("comparisons")]
    saved += [LAYOUT.model_record(name) for name in AUDITED_CHECKPOINTS]
    if TRANSPLANT["enabled"]:
        saved += [LAYOUT.table("transplants"), LAYOUT.selection]
    if FACTOR_LEVELS:
        saved.append(LAYOUT.table("factors"))
    return saved + [LAYOUT.audited(path) for path in saved]


# --- the report (report.smk) ---------------------------------------------------------------------


def e4_option(wildcards):
    """audit/e4.json for the card once the audit has written it (not an input: a plain run never
    runs the audit; the card shows E4 only if it describes the current tables)."""
    return f"--e4 {shlex.quote(LAYOUT.e4)}" if Path(LAYOUT.e4).is_file() else ""


def e4_version(wildcards):
    """A rerun trigger: after `snakemake audit` writes (or rewrites) e4.json, a plain run redraws the card."""
    from stagereplay.ledger.fingerprint import file_digest

    path = Path(LAYOUT.e4)
    return file_digest(path) if path.is_file() else "none"
