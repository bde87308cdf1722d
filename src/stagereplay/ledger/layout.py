"""Where everything lies in a ledger: the one place that knows its layout.

The workflow (``workflow/rules/common.smk``) builds every output path from a
:class:`LedgerLayout`, and the library (audit, verify, the CLI) reads through the same
object, so a path is never rebuilt by hand. Called with Snakemake wildcards
(``"{checkpoint}"``) the methods give the rules' path patterns. The audit tree is
a ledger of its own (``ledger.audit``), laid out like the saved one. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TABLES = ("trajectories", "comparisons", "transplants", "audit")


def construction_token(construction: str) -> str:
    """'chunked:16' -> 'chunked-16': a path component without a colon."""
    return construction.replace(":", "-")


def construction_name(token: str) -> str:
    """The inverse of :func:`construction_token`."""
    return token.replace("-", ":")


@dataclass(frozen=True)
class LedgerLayout:
    root: Path

    def __init__(self, root: str | Path = "") -> None:
        object.__setattr__(self, "root", Path(root))

    def path(self, *parts: str | int) -> str:
        return str(self.root.joinpath(*map(str, parts)))

    # What every stage starts from.
    @property
    def items(self) -> str:
        return self.path("items.jsonl")

    def prompts(self, checkpoint: str) -> str:
        return self.path("prompts", f"{checkpoint}.parquet")

    def vocab(self, checkpoint: str) -> str:
        """Each token id of the checkpoint as the report spells it (tables.VOCAB_SCHEMA)."""
        return self.path("vocab", f"{checkpoint}.parquet")

    def model_dir(self, checkpoint: str) -> str:
        """Where a checkpoint is converted or built (a user's own folder is used where it lies)."""
        return self.path("models", checkpoint)

    def model_record(self, checkpoint: str) -> str:
        return self.path("models", checkpoint, "model.json")

    @property
    def storage(self) -> str:
        """storage.json: the store_caches policy, written only when it is not all (stagereplay.design.storage)."""
        return self.path("storage.json")

    @property
    def downloads(self) -> str:
        return self.path("downloads")

    # The model jobs' shard tables and the objects they name.
    @property
    def objects(self) -> str:
        return self.path("objects")

    def live_table(self, checkpoint: str, precision: str, replica: int | str, shard: str) -> str:
        return self.path("runs", "live", checkpoint, precision, f"rep{replica}", f"shard-{shard}.parquet")

    def rebuilt_table(
        self, checkpoint: str, prefix_precision: str, precision: str, construction: str, replica: int | str, shard: str
    ) -> str:
        return self.path(
            "runs",
            "rebuild",
            checkpoint,
            f"{prefix_precision}-prefix",
            precision,
            construction_token(construction),
            f"rep{replica}",
            f"shard-{shard}.parquet",
        )

    def transplant_table(self, selection: str, checkpoint: str, precision: str, shard: str) -> str:
        return self.path("runs", "transplant", selection, checkpoint, precision, f"shard-{shard}.parquet")

    @property
    def selection(self) -> str:
        return self.path("transplants", "selection.json")

    # What is gathered and computed from them.
    def table(self, name: str) -> str:
        if name not in TABLES:
            raise ValueError(f"no ledger table {name!r} (one of {', '.join(TABLES)})")
        return self.path("tables", f"{name}.parquet")

    @property
    def summary(self) -> str:
        return self.path("summary.json")

    @property
    def card(self) -> str:
        return self.path("results.md")

    @property
    def report_dir(self) -> str:
        return self.path("report")

    @property
    def card_html(self) -> str:
        return self.path("report", "results.html")

    # E4: the audit tree, a ledger laid out like this one, and what the audit writes.
    @property
    def audit(self) -> LedgerLayout:
        return LedgerLayout(self.root / "audit")

    @property
    def audit_verified(self) -> str:
        return self.audit.path("verified.txt")

    @property
    def e4(self) -> str:
        """The E4 figures, beside the audit table (tables/audit.parquet)."""
        return self.audit.path("e4.json")

    def audited(self, path: str | Path) -> str:
        """The audit tree's twin of a path of this ledger."""
        return self.audit.path(Path(path).relative_to(self.root))

    # Job logs and benchmarks (the audit's under logs/audit/ and benchmarks/audit/).
    def log(self, *parts: str) -> str:
        return self.path("logs", *parts)

    def benchmark(self, *parts: str) -> str:
        return self.path("benchmarks", *parts)


# Paths relative to a ledger's root, as verify names them.
RELATIVE = LedgerLayout()
