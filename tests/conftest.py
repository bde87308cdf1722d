"""Shared fixtures: a tiny randomly initialised Qwen2 (real transformers code path, seconds to run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from workflow_helpers import snakemake, write_config

from stagereplay.engines.transformers.engine import Runtime, load_model
from stagereplay.inputs.checkpoints import build_random_qwen2

REPO = Path(__file__).resolve().parents[1]

# The modules whose tests take longest, longest first (summed test time per module, docs/performance.md). The two
# workers take whole modules in collection order (pyproject.toml: --dist loadfile --no-loadscope-reorder), so these
# start first and the run does not end on one worker computing a long module while the other waits.
LONGEST_MODULES = (
    "test_served.py",
    "test_audit.py",
    "test_llamacpp_factors.py",
    "test_storage.py",
    "test_bad_input.py",
    "test_attached_engine.py",
    "test_two_checkpoints.py",
    "test_llamacpp_workflow.py",
    "test_provenance.py",
    "test_slurm.py",
    "test_embedded.py",
    "test_factors.py",
    "test_llamaserver_factors.py",
)


def pytest_collection_modifyitems(items):
    """Longest modules first, then the rest in their collected order (a stable sort keeps each module's order)."""
    rank = {name: index for index, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_MODULES)))


@pytest.fixture(scope="session")
def tiny_qwen2_folder(tmp_path_factory) -> Path:
    return build_random_qwen2(tmp_path_factory.mktemp("tiny") / "model", seed=0, layers=2, hidden=64)


@pytest.fixture(scope="session")
def tiny_fp32(tiny_qwen2_folder):
    return load_model(tiny_qwen2_folder, Runtime(precision="fp32", device="cpu", threads=1))


@pytest.fixture(scope="session")
def tiny_bf16(tiny_qwen2_folder):
    return load_model(tiny_qwen2_folder, Runtime(precision="bf16", device="cpu", threads=1))


@pytest.fixture(autouse=True)
def _fixed_threads():
    # Library code sets threads per job; tests must not inherit a changed count from each other.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def test_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """One real snakemake run of config/test.yaml (tiny random Qwen2, 4 items): (workdir, ledger, config).

    Shared by every module that reads a finished ledger; tests that damage or extend
    a ledger work on a copy (workflow_helpers.copy_run).
    """
    workdir = tmp_path_factory.mktemp("run")
    ledger = workdir / "ledger"
    config = write_config(workdir / "config.yaml", ledger_dir=str(ledger))
    result = snakemake(workdir, config)
    assert result.returncode == 0, result.stderr[-4000:]
    return workdir, ledger, config
