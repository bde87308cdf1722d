"""A fourth engine costs its own folder and one entry point, and no file under src/.

tests/toy_engine/ is a distribution of its own as Python finds one on its path: a package (``toy_engine``: a spec
and a thin subclass of the transformers engine whose rows name it) and its metadata, whose entry point in the
``stagereplay.engines`` group names the spec. With that folder on PYTHONPATH, the registry lists the engine,
and the tiny workflow runs E1 and one E6 factor on it: every process snakemake starts finds it the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from workflow_helpers import snakemake, write_config

TOY = Path(__file__).resolve().parent / "toy_engine"


@pytest.fixture
def toy_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TOY), os.environ.get("PYTHONPATH")])))


def test_the_registry_lists_an_engine_plugged_in_by_its_entry_point(toy_on_path):
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from stagereplay.engines.registry import ENGINES, SPECS; print(ENGINES, SPECS['toy'].engine_class())",
        ],
        capture_output=True,
        text=True,
    )
    assert listed.returncode == 0, listed.stderr
    assert (
        listed.stdout.strip()
        == "('transformers', 'llamacpp', 'llamaserver', 'toy') <class 'toy_engine.engine.ToyEngine'>"
    )


@pytest.mark.slow
def test_the_tiny_workflow_runs_e1_and_a_factor_on_the_toy_engine(toy_on_path, tmp_path):
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints={"tiny-toy": {"random_qwen2": {"seed": 2, "layers": 4, "hidden": 64}, "engine": "toy"}},
        fixed_prefix={"precisions": ["bf16"]},
        transplant={"enabled": False},
        factors={"threads": [2]},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    factors = pq.read_table(ledger / "tables" / "factors.parquet").to_pylist()
    assert trajectories and {row["engine"] for row in trajectories} == {"toy"}
    assert factors and {row["engine"] for row in factors} == {"toy"}
    assert json.loads((ledger / "models" / "tiny-toy" / "model.json").read_text())["engine"] == "toy"
    summary = json.loads((ledger / "summary.json").read_text())
    assert summary["E1"]["checkpoints"]["tiny-toy"]
    controls = summary["E6"]["controls"]
    assert controls["paths"] == controls["identical"] == 1


def test_a_second_engine_of_a_taken_name_is_refused_in_one_line():
    from stagereplay.engines.registry import register
    from stagereplay.engines.spec import SpecError
    from stagereplay.engines.transformers.spec import TRANSFORMERS

    with pytest.raises(SpecError, match="^engine 'transformers' is registered twice — give the new engine a name"):
        register(TRANSFORMERS)
