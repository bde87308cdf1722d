# Everything the rule files share (and nothing else) — the checked config, the ledger
# layout (stagereplay.ledger.layout), parse-time checks, and the input functions and path
# lists of every experiment. Rule files hold only rules and read only what is here; what a
# job's command line holds is stagereplay.design.job_args.

import json
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from stagereplay.design import job_args
from stagereplay.design.factors import FACTORS as FACTOR_NAMES
from stagereplay.design.factors import factor_named
from stagereplay.engines.registry import PRECISION_PATTERN
from stagereplay.ledger.layout import construction_of_token
from stagereplay.ledger.provenance import design_of

REPO = Path(workflow.basedir)
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def _run_config():
    """The config this run computes. Under `--config mode=audit` (E4) that is the design recorded in the
    ledger (provenance.json), never the config on disk: a ledger handed over, or a config edited since the
    run, is audited as it was made. An explicit flag, because snakemake names its targets only after this
    file is parsed (a cluster node parses it again with the same flag)."""
    if config.get("mode", "run") != "audit":
        return config
    from stagereplay.audit.recorded_design import AuditRefused, audit_config

    try:
        audited, note = audit_config(config)
    except AuditRefused as error:
        raise WorkflowError(str(error)) from None
    if note:
        print(note, file=sys.stderr)
    return audited


CONFIG = _run_config()
AUDITING = CONFIG.get("mode") == "audit"


def _run_plan():
    """The config checked and completed with the schema's defaults, then every parse-time check
    (stagereplay.design.run_plan, which `stagereplay plan` runs too): a bad config, item file or
    model fails here, before any job, in one line."""
    from stagereplay.design.run_plan import RunRefused, plan_run
    from stagereplay.design.schema import ConfigError, resolve_config

    try:
        resolve_config(CONFIG, SCHEMA)
        return plan_run(CONFIG, REPO, AUDITING)
    except (ConfigError, RunRefused) as error:
        raise WorkflowError(str(error)) from None


RUN = _run_plan()

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
# Under `--config mode=audit`, each of the run's rules needs this file, which never exists; each saved file is then
# an input the audit reads, never a job it may rerun (after a copy that changed file times, a config edited
# since the run, a changed command). Snakemake refuses such a job before any job starts, naming this file.
AUDIT_GUARD = (
    [str(LAYOUT.root / "the-audit-never-reruns-the-saved-ledger--finish-the-run-with-a-plain-snakemake-first")]
    if AUDITING
    else []
)
# `snakemake audit` without the flag: the audit's first job needs this file, which never exists, so snakemake
# stops before any job, naming the flag (the audit's jobs come from the recorded design, chosen at parse time).
AUDIT_NEEDS_MODE = [] if AUDITING else [str(LAYOUT.root / "the-audit-runs-as--snakemake--config-mode=audit")]
CHECKPOINTS = CONFIG["checkpoints"]
PRIMARY = RUN.primary
RUNTIME = CONFIG["runtime"]
STAGE = CONFIG["stage"]
MATCHED = CONFIG["matched"]
E1 = MATCHED["precision"]
FIXED = CONFIG["fixed_prefix"]
TRANSPLANT = CONFIG["transplant"]
SWEEP = TRANSPLANT["sweep"]
BLIND = TRANSPLANT["outcome_blind"]
BLIND_CHECKPOINT = RUN.blind_checkpoint
ITEMS_SPEC = CONFIG["items"]
# What the ledger records as the run's design (provenance.json; the audit reruns it).
DESIGN = design_of(CONFIG)
EMBEDDED_MODEL = CONFIG["embedded_model"]
AUDIT_RUNTIME = RUN.audit_runtime
# Which cache tensors are stored (stagereplay.design.storage says what each policy keeps).
STORE_CACHES = CONFIG["store_caches"]
AUDIT_STORE_CACHES = RUN.audit_store_caches
# Every trajectory and transplant job the config schedules (the projection counts the same list).
JOBS = RUN.jobs
# Checkpoints other than the primary one: only the outcome-blind replication's, with E1 live and prefill (rep0).
REPLICATIONS = list(JOBS.replications)
USED_CHECKPOINTS = RUN.used_checkpoints
AUDITED_CHECKPOINTS = RUN.audited_checkpoints
SHARDS = RUN.shards
CONSTRUCTIONS = RUN.constructions
BLIND_IDS = RUN.blind_ids
# The longest sequence a model job holds: the longest prompt, the stage and the suffix.
MAX_POSITIONS = RUN.max_positions
FACTOR_LEVELS = RUN.factor_levels
LOAD_RUNS = CONFIG["load_runs"]
SERVED = CONFIG["served"]
SERVED_SERVERS = RUN.served_servers
SERVED_DESIGN_ARGS = job_args.served_design(SERVED, RUN.served_tokens, CONFIG["stage"]["max_new_tokens"])


wildcard_constraints:
    checkpoint="[A-Za-z0-9][A-Za-z0-9._-]*",
    precision=PRECISION_PATTERN,
    prefix_precision=PRECISION_PATTERN,
    construction=r"incremental|prefill|chunked-[1-9][0-9]*",
    replica=r"\d+",
    shard=r"\d{3}",
    server=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    selection="selected|outcome_blind|cross_precision",
    factor="|".join(FACTOR_NAMES),
    level=r"[A-Za-z0-9_-]+",


# --- model jobs' arguments and resources ---------------------------------------------------------


def runtime_args(wildcards, replica=None, runtime=RUNTIME, store_caches=None):
    return job_args.runtime_args(CONFIG, runtime, wildcards, MAX_POSITIONS, replica, store_caches)


def audit_runtime_args(wildcards, replica=None):
    return runtime_args(wildcards, replica, AUDIT_RUNTIME, AUDIT_STORE_CACHES)


def rebuild_args(ledger, runtime):
    return job_args.rebuild_args({name: ledger.model_record(name) for name in COMPARED_CHECKPOINTS}, runtime)


COMPARED_CHECKPOINTS = RUN.compared_checkpoints
# compare rebuilds caches that are not stored, so then it is a model job (a cluster job, not a local one):
# a resource, not a rerun trigger (its inputs and command are the same at every policy).
COMPARE_REBUILDS = STORE_CACHES != "all"
AUDIT_COMPARE_REBUILDS = AUDIT_STORE_CACHES != "all"


MODEL_RESOURCES = RUN.model_resources(RUNTIME)
AUDIT_MODEL_RESOURCES = RUN.model_resources(AUDIT_RUNTIME)


# --- the job list (stagereplay.design.jobs) as shard tables ------------------------------------


def shard_table(ledger, trajectory, shard):
    return ledger.trajectory_table(*trajectory.fields(), shard)


def all_shard_tables():
    """Every trajectory table of the job list: E1, E2, E3 and the outcome-blind checkpoint's E1."""
    return sorted({shard_table(LAYOUT, trajectory, shard) for trajectory in JOBS.trajectories for shard in SHARDS})


# --- E5 (transplant.smk) -------------------------------------------------------------------------


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


# --- the report (report.smk) ---------------------------------------------------------------------


def e4_option(wildcards):
    """audit/e4.json for the card once the audit has written it (not an input: a plain run never
    runs the audit; the card shows E4 only if it describes the current tables)."""
    return f"--e4 {shlex.quote(LAYOUT.e4)}" if Path(LAYOUT.e4).is_file() else ""


def e4_version(wildcards):
    """A rerun trigger: after the audit writes (or rewrites) e4.json, a plain run redraws the card."""
    from stagereplay.ledger.fingerprint import file_digest

    path = Path(LAYOUT.e4)
    return file_digest(path) if path.is_file() else "none"
