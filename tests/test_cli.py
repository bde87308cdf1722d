import subprocess
import sys

import pytest

from stagereplay.cli import build_parser

SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def test_every_stage_has_a_subcommand():
    assert {"items", "prompts", "live", "rebuild", "gather", "summarize", "convert-gguf"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_help_on_every_subcommand(subcommand):
    result = subprocess.run([sys.executable, "-m", "stagereplay", subcommand, "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: stagereplay {subcommand}")


def test_library_errors_are_one_line_and_exit_non_zero(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagereplay",
            "items",
            "--source",
            str(tmp_path / "missing.jsonl"),
            "--out",
            str(tmp_path / "out.jsonl"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("stagereplay: error: ")
    assert "missing.jsonl" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_model_jobs_options_give_one_context(tmp_path):
    """cli.options.job_context: every model job's context, built in one place from its parsed options."""
    import json

    from stagereplay.cli.options import job_context
    from stagereplay.design.storage import StorageError
    from stagereplay.engines.registry import spec_for_record
    from stagereplay.engines.runtime import runtime_from_args
    from stagereplay.experiments.job import ShardSpec

    record = tmp_path / "model.json"
    record.write_text(json.dumps({"fingerprint": "f" * 32, "folder": "model"}))
    (tmp_path / "storage.json").write_text("{}")  # the ledger of the store below names no policy
    options = ["--model-record", str(record), "--items", "items.jsonl", "--checkpoint", "tiny"]
    options += ["--precision", "bf16", "--threads", "1", "--shard", "2", "--shard-size", "4", "--suffix-tokens", "8"]
    options += ["--store", str(tmp_path / "objects"), "--out", "out.parquet"]
    factor = ["factor", *options, "--factor", "batch", "--level", "4", "--reference", "r.parquet"]
    args = build_parser().parse_args(factor)
    context = job_context(args)
    assert context.record_path == str(record)
    assert context.record["folder"] == str((tmp_path / "model").resolve())
    assert context.engine_spec is spec_for_record(context.record)
    assert context.runtime == runtime_from_args(args)
    assert context.shard_spec == ShardSpec("tiny", "bf16", replica=0, shard=2, shard_size=4)
    assert (context.items_path, context.prompts_path, context.suffix_tokens) == ("items.jsonl", None, 8)
    assert context.out_path == "out.parquet"
    assert context.source_store_root is None and context.source_store().root == context.store().root
    # The policy is read from the ledger only when a job stores: a factor job, which never does, is not stopped.
    with pytest.raises(StorageError, match="names no store_caches policy"):
        context.cache_policy()
    live = ["live", *options, "--prompts", "p.parquet", "--max-new-tokens", "12", "--store-caches", "none"]
    context = job_context(build_parser().parse_args([*live, "--source-store", "saved"]))
    assert (context.prompts_path, context.cache_policy(), context.source_store_root) == ("p.parquet", "none", "saved")
