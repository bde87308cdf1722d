import json
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

REPO = Path(workflow.basedir)

SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def _check_config():
    from stagereplay.configcheck import config_problem

    problem = config_problem(config, SCHEMA)
    if problem:
        raise WorkflowError(problem)
    validate(config, str(SCHEMA))  # fills in the schema's defaults


_check_config()

# Rules call the CLI through this interpreter, so it works without an activated venv.
STAGEREPLAY = f"{sys.executable} -m stagereplay"
LEDGER = Path(config["ledger_dir"])
if LEDGER.exists() and not LEDGER.is_dir():
    raise WorkflowError(f"ledger_dir {LEDGER} is a file, not a directory — point ledger_dir at a directory (new or of an earlier run)")
CHECKPOINTS = config["checkpoints"]
PRIMARY = next(iter(CHECKPOINTS))
RUNTIME = config["runtime"]
STAGE = config["stage"]
MATCHED = config["matched"]
FIXED = config["fixed_prefix"]


def ledger(*parts):
    return str(LEDGER.joinpath(*parts))


def repo_path(path):
    """Config paths are relative to the repository, not to where snakemake was started."""
    path = Path(path).expanduser()
    return str(path if path.is_absolute() else REPO / path)


def parse_time_items():
    """Item ids are known at parse time (no checkpoints): a bad item file fails here, before any job."""
    from stagereplay.items import ItemError, load_items

    spec = config["items"]
    try:
        return load_items(repo_path(spec["source"]), spec["format"], spec["shuffle_seed"], spec["limit"])
    except ItemError as error:
        raise WorkflowError(str(error)) from None


ITEMS = parse_time_items()
SHARDS = [f"{index:03d}" for index in range((len(ITEMS) + config["shard_size"] - 1) // config["shard_size"])]


def parse_time_constructions():
    """Construction names are checked here, so a typo fails before any job."""
    from stagereplay.plan import ConstructionError, parse_construction

    names = FIXED["constructions"]
    try:
        kinds = [parse_construction(name)[0] for name in names]
    except ConstructionError as error:
        raise WorkflowError(f"fixed_prefix.constructions: {error}") from None
    if "live" in kinds:
        raise WorkflowError("fixed_prefix.constructions: live is generated, not rebuilt — list only incremental, prefill or chunked:N")
    if "incremental" not in names:
        raise WorkflowError("fixed_prefix.constructions must include incremental (every E2 comparison is against it) — add it")
    return names


CONSTRUCTIONS = parse_time_constructions()


def construction_token(name):
    """'chunked:16' -> 'chunked-16': a path component without a colon."""
    return name.replace(":", "-")


wildcard_constraints:
    checkpoint="[A-Za-z0-9][A-Za-z0-9._-]*",
    precision="bf16|fp16|fp32",
    prefix_precision="bf16|fp16|fp32",
    construction=r"incremental|prefill|chunked-[1-9][0-9]*",
    replica=r"\d+",
    shard=r"\d{3}",


def runtime_args(wildcards, replica=None, runtime=RUNTIME):
    args = [
        f"--checkpoint {wildcards.checkpoint}",
        f"--precision {wildcards.precision}",
        f"--device {runtime['device']}",
        f"--threads {runtime['threads']}",
        f"--attn-implementation {runtime['attn_implementation']}",
        f"--shard {int(wildcards.shard)}",
        f"--shard-size {config['shard_size']}",
        f"--replica {int(wildcards.replica) if replica is None else replica}",
        f"--suffix-tokens {STAGE['suffix_tokens']}",
    ]
    if runtime["trust_remote_code"]:
        args.append("--trust-remote-code")
    return " ".join(args)


MODEL_RESOURCES = dict(
    mem_mb=RUNTIME["mem_mb"],
    runtime=RUNTIME["runtime_minutes"],
    gpu=1 if RUNTIME["device"] == "cuda" else 0,
)


SOURCES = ("embedded", "folder", "gguf", "random_qwen2")


def checkpoint_source(name):
    spec = CHECKPOINTS[name]
    given = [key for key in SOURCES if key in spec]
    if len(given) != 1:
        raise WorkflowError(
            f"checkpoint {name!r} must name exactly one source of {', '.join(SOURCES)} (got {given or 'none'}) — fix checkpoints.{name}"
        )
    if "sha256" in spec and given[0] != "gguf":
        raise WorkflowError(f"checkpoint {name!r}: sha256 applies only to a gguf source — remove it or use gguf:")
    source = given[0]
    if source in ("folder", "gguf") and not Path(repo_path(spec[source])).exists():
        raise WorkflowError(
            f"checkpoint {name!r}: {source} {repo_path(spec[source])} does not exist — fix checkpoints.{name}.{source}"
        )
    if source == "folder" and not Path(repo_path(spec["folder"]), "config.json").is_file():
        raise WorkflowError(
            f"checkpoint {name!r}: {repo_path(spec['folder'])} has no config.json — point checkpoints.{name}.folder at a Hugging Face model folder"
        )
    return source


for _name in CHECKPOINTS:
    checkpoint_source(_name)


def model_folder(name):
    source = checkpoint_source(name)
    if source == "folder":
        return repo_path(CHECKPOINTS[name]["folder"])
    if source == "random_qwen2":
        return ledger("models", name, "random")
    return ledger("models", name, "converted")

# Every shell command below ends with `|| { tail -n 1 LOG >&2; exit 1; }`: the CLI's
# one-line error (the last line of the job's log) is repeated on the console.
