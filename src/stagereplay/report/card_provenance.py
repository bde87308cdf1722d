"""What a reader needs to rerun a card's figures: the version, the items (with their digest), the models, the environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stagereplay.ledger.fingerprint import bytes_digest


@dataclass(frozen=True)
class Provenance:
    """What a reader needs to rerun the figures: the model, the items, the environment."""

    version: str
    item_source: str
    item_count: int
    item_digest: str
    models: list[dict]  # model.json records, each with its checkpoint name
    environment: list[dict]  # summary.json's environment entries


def provenance(summary: dict, item_source: str, items_path: str | Path, model_records: dict[str, dict]) -> Provenance:
    items = Path(items_path).read_bytes()
    return Provenance(
        version=summary["stagereplay_version"],
        item_source=item_source,
        item_count=sum(1 for line in items.splitlines() if line.strip()),
        item_digest=bytes_digest(items),
        models=[{"checkpoint": name, **record} for name, record in model_records.items()],
        environment=summary["environment"],
    )
