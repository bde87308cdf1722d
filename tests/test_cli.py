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
