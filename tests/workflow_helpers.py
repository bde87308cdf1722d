"""Run the real workflow with real snakemake in a temporary directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import xxhash
import yaml

REPO = Path(__file__).resolve().parents[1]


def write_config(path: Path, base: str = "config/test.yaml", **overrides) -> Path:
    config = yaml.safe_load((REPO / base).read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict) and key != "checkpoints":
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake(workdir: Path, configfile: Path, *extra: str, cores: int = 2) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(configfile),
        "--cores", str(cores), "--directory", str(workdir), *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, cwd=workdir)


def ledger_snapshot(ledger: Path) -> dict[str, str]:
    """Content digest of every file in the ledger, by relative path."""
    return {
        str(path.relative_to(ledger)): xxhash.xxh3_128(path.read_bytes()).hexdigest()
        for path in sorted(ledger.rglob("*")) if path.is_file()
    }
