"""Run the real workflow with real snakemake in a temporary directory."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import pyarrow.parquet as pq
import xxhash
import yaml

REPO = Path(__file__).resolve().parents[1]


def bench_script(name: str):
    """``bench/<name>.py`` imported as a module (bench/ is scripts, not a package), for its functions."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_unless_required(problem: str | None, variable: str) -> None:
    """Skip with ``problem``; fail instead when CI sets ``variable`` to 1 (the part must run there)."""
    import pytest

    if problem is None:
        return
    if os.environ.get(variable) == "1":
        pytest.fail(f"{variable}=1 but {problem}")
    pytest.skip(problem)


def write_config(path: Path, base: str = "config/test.yaml", **overrides) -> Path:
    config = yaml.safe_load((REPO / base).read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict) and key != "checkpoints":
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake_command(workdir: Path, configfile: Path, *extra: str, cores: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--configfile",
        str(configfile),
        "--cores",
        str(cores),
        "--directory",
        str(workdir),
        *extra,
    ]


def snakemake(workdir: Path, configfile: Path, *extra: str, cores: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(
        snakemake_command(workdir, configfile, *extra, cores=cores), capture_output=True, text=True, cwd=workdir
    )


def stagereplay(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagereplay", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


def copy_run(workdir: Path, destination: Path) -> tuple[Path, Path]:
    """A copy of a finished run (ledger, config and snakemake's metadata; mtimes kept) to damage or extend.

    The copied config is rewritten to point at the copied ledger.
    """
    shutil.copytree(workdir, destination, symlinks=True)
    config = destination / "config.yaml"
    data = yaml.safe_load(config.read_text())
    data["ledger_dir"] = str(destination / "ledger")
    config.write_text(yaml.safe_dump(data))
    return destination / "ledger", config


# The fingerprints a rerun must reproduce, per row of each gathered table.
FINGERPRINTS = {
    "trajectories": (
        ("checkpoint", "construction", "precision", "prefix_precision", "replica", "item_id"),
        ("model_fingerprint", "prefix_object", "cache_object", "layer_k", "layer_v", "suffix_object"),
    ),
    "transplants": (
        ("selection", "checkpoint", "item_id", "donor", "recipient", "precision", "subset"),
        ("cache_digest", "layer_k", "layer_v", "suffix_object", "outcome"),
    ),
}


def fingerprints(ledger: Path) -> dict[tuple, tuple]:
    """Every fingerprint of a finished ledger, keyed by table and row identity."""
    result = {}
    for table, (key, values) in FINGERPRINTS.items():
        for row in pq.read_table(ledger / "tables" / f"{table}.parquet").to_pylist():
            result[(table, *(row[name] for name in key))] = tuple(
                tuple(row[name]) if isinstance(row[name], list) else row[name] for name in values
            )
    return result


def ledger_snapshot(ledger: Path) -> dict[str, str]:
    """Content digest of every file in the ledger, by relative path."""
    return {
        str(path.relative_to(ledger)): xxhash.xxh3_128(path.read_bytes()).hexdigest()
        for path in sorted(ledger.rglob("*"))
        if path.is_file()
    }


def job_counts(result) -> dict[str, int]:
    """Jobs per rule from the 'Job stats' table of a dry run."""
    lines = result.stdout.splitlines()
    start = lines.index("Job stats:") + 3
    counts = {}
    for line in lines[start:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def rewrite_live_suffix(ledger: Path, replica: int = 1) -> dict:
    """Give the first row of a saved live shard other suffix tokens, with every digest valid.

    The new suffix is stored as a proper object and the shard table rewritten with the
    digest of its rows, so the ledger is self-consistent: only recomputing the row tells
    it apart. Replica 1 feeds nothing but its replica comparison (no rebuild, no E5
    selection), so the change stays on that one item. Returns the rewritten row.
    """
    from stagereplay.ledger.store import ObjectStore
    from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, VOCAB_SCHEMA, read_table, write_table
    from stagereplay.ledger.text import rebuilt_text

    shard = sorted((ledger / "runs" / "live").glob(f"*/*/rep{replica}/shard-*.parquet"))[0]
    rows = read_table(shard, TRAJECTORY_SCHEMA).to_pylist()
    row = rows[0]
    tokens = [token + 1 for token in row["suffix_tokens"]]  # as long as before: one margin per token still
    row["suffix_object"] = ObjectStore(ledger / "objects").put_tokens(tokens)
    row["suffix_tokens"] = tokens
    vocabulary = read_table(ledger / "vocab" / f"{row['checkpoint']}.parquet", VOCAB_SCHEMA).to_pydict()
    row["suffix_text"] = rebuilt_text(tokens, dict(zip(vocabulary["token_id"], vocabulary["text"])))
    write_table(rows, TRAJECTORY_SCHEMA, shard)
    return row


# Not part of the stored ledger: job logs and benchmarks, the audit's own tree, the downloaded GGUF.
NOT_STORED = ("logs", "benchmarks", "audit", "downloads")


def measured_storage(ledger: Path, checkpoints: Collection[str] | None = None) -> dict[str, int]:
    """A finished ledger's bytes as its files' sizes: the boundary caches its trajectories name, and
    everything it stores (less what NOT_STORED names and hidden files). With ``checkpoints``, only
    their model folders count (the shared test ledger also holds models other tests registered)."""
    rows = pq.read_table(ledger / "tables" / "trajectories.parquet", columns=["cache_object"]).column(0).to_pylist()
    caches = sum((ledger / "objects" / name[:2] / f"{name}.safetensors").stat().st_size for name in set(rows))

    def counted(parts: tuple[str, ...]) -> bool:
        if parts[0] == "models" and checkpoints is not None and len(parts) > 1:
            return parts[1] in checkpoints
        return parts[0] not in NOT_STORED

    total = sum(
        path.stat().st_size
        for path in ledger.rglob("*")
        if path.is_file() and counted(path.relative_to(ledger).parts) and not path.name.startswith(".")
    )
    return {"caches": caches, "ledger": total}


def shared_prefix_items(ledger: Path, checkpoint: str) -> set[int]:
    """Items (indices in the prompt table's order) whose every live run reproduced the E1 prefix."""
    prompts = pq.read_table(ledger / "prompts" / f"{checkpoint}.parquet", columns=["item_id"]).column(0).to_pylist()
    prefixes: dict[str, set[str]] = {}
    for row in pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist():
        if row["construction"] == "live" and row["checkpoint"] == checkpoint:
            prefixes.setdefault(row["item_id"], set()).add(row["prefix_object"])
    return {index for index, item in enumerate(prompts) if len(prefixes.get(item, ())) == 1}


def check_storage_plan(ledger: Path, config_path: Path, tolerance: float = 0.05) -> None:
    """The storage plan of a run's config against its finished ledger (store_caches: all)."""
    from stagereplay.design.run_plan import plan_run
    from stagereplay.design.schema import load_config
    from stagereplay.design.storage_plan import project, project_run

    config = load_config(config_path)
    projection, shapes, _ = project_run(plan_run(config, REPO))
    assert projection.prompt_measured  # the run's own prompt lengths
    checkpoint = next(iter(config["checkpoints"]))
    shared = shared_prefix_items(ledger, checkpoint)
    # The one outcome the plan cannot know: which items' other-precision live runs reproduce the E1 prefix.
    exact = project(
        config,
        shapes,
        projection.prompt_tokens,
        True,
        model_in_ledger=True,
        shared_prefix_items=shared,
    )
    measured = measured_storage(ledger, config["checkpoints"])
    assert abs(exact.cache_bytes["all"] / measured["caches"] - 1) < tolerance, (exact.cache_bytes, measured)
    assert abs(exact.ledger_bytes("all") / measured["ledger"] - 1) < tolerance, (exact.parts("all"), measured)
    # Without that outcome the plan is an upper bound.
    assert projection.cache_bytes["all"] >= measured["caches"]
