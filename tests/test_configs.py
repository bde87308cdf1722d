"""Every config the project ships schedules a whole run: a dry run of each succeeds, so none can rot."""

from __future__ import annotations

import pytest
from workflow_helpers import REPO, snakemake, write_config

SHIPPED = sorted(
    str(path.relative_to(REPO)) for path in [*REPO.glob("config/*.yaml"), *REPO.glob("bench/config_*.yaml")]
)


@pytest.mark.parametrize("config", SHIPPED)
def test_shipped_config_dry_runs(config, tmp_path):
    # The config as shipped, in a fresh ledger: every job from the model on is scheduled.
    configfile = write_config(tmp_path / "config.yaml", base=config, ledger_dir=str(tmp_path / "ledger"))
    result = snakemake(tmp_path, configfile, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    scheduled = result.stdout + result.stderr
    for rule in ("register_model", "live", "rebuild", "compare", "summary", "report"):
        assert f"rule {rule}:" in scheduled, (config, rule)
