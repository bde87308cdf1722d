"""A non-editable install works away from the source tree: the schema and the model shapes are package
data. The package is built from a copy of the tree (pip writes build/ and *.egg-info where it builds)
into a target folder without its dependencies, which the running environment already has."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml
from workflow_helpers import REPO

from stagereplay.ledger.tables import VOCAB_SCHEMA, write_table

pytestmark = pytest.mark.slow


def test_an_installed_copy_plans_and_verifies_from_another_directory(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(REPO / "src", tree / "src", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "workflow" / "schemas", tree / "workflow" / "schemas")  # what the schema link names
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    result = subprocess.run([*install, "--target", str(target), str(tree)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (target / "stagereplay" / "resources" / "config.schema.yaml").is_symlink()

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    shutil.copy(REPO / "data" / "items.jsonl", elsewhere / "data" / "items.jsonl")  # relative to the working directory
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    config["ledger_dir"] = str(elsewhere / "ledger")
    (elsewhere / "config.yaml").write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)

    def run(*args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=elsewhere, env=env)

    where = run("-c", "import stagereplay; print(stagereplay.__file__)")
    assert where.stdout.strip() == str(target / "stagereplay" / "__init__.py"), where.stdout + where.stderr

    plan = run("-m", "stagereplay", "plan", "--configfile", "config.yaml")
    assert plan.returncode == 0, plan.stderr
    assert "store_caches" in plan.stdout
    named = run("-m", "stagereplay", "plan", "--configfile", "config.yaml", "--model-config", "qwen2.5-7b-instruct")
    assert named.returncode == 0, named.stderr
    bad = run("-m", "stagereplay", "plan", "--configfile", str(REPO / "config" / "test.yaml"), "--model-config", "x")
    assert "one of: qwen2.5-14b-instruct, qwen2.5-7b-instruct, smollm2-135m-instruct" in bad.stderr

    (elsewhere / "broken.yaml").write_text(yaml.safe_dump({**config, "shard_size": "four"}))
    refused = run("-m", "stagereplay", "plan", "--configfile", "broken.yaml")
    assert refused.returncode != 0
    assert f"(allowed keys and values: {target / 'stagereplay' / 'resources' / 'config.schema.yaml'})" in refused.stderr

    assert run("-m", "stagereplay", "verify", "--help").returncode == 0
    ledger = elsewhere / "ledger"
    (ledger / "objects").mkdir(parents=True)
    write_table([{"token_id": 1, "text": "A"}], VOCAB_SCHEMA, ledger / "vocab" / "tiny.parquet")
    verified = run("-m", "stagereplay", "verify", "ledger")
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("verify: ledger OK — 0 objects, 1 tables, 1 rows checked")
