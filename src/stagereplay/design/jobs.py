"""The one job list: every trajectory and every transplant job a resolved config schedules.

The workflow's input functions (``workflow/rules/common.smk``) turn these into shard-table paths
with the ledger layout, and the storage and compute projection (``design.storage_plan``) counts
them; neither derives the design on its own. No torch and no files: a config with the schema's
defaults filled in (``design.schema.resolve_config``) is all it reads.

Per checkpoint and item, the primary checkpoint records
- E1: live and a one-shot prefill at the E1 precision, each with its replicas;
- E2: every construction of ``fixed_prefix`` at every precision over the E1 live prefix;
- E3: at every precision, its own live run and the incremental rebuild of that run's prefix
  (at the E1 precision both exist already, as E1 live and E2 incremental);
and the outcome-blind checkpoint, when it is another one, E1 live and prefill (replica 0).
E5 adds one transplant job per selection, checkpoint and precision (shards of items each).
The comparisons (E1, E2, E3) pair these trajectories, always within one checkpoint (``comparisons``).
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass

from stagereplay.ledger.tables import TRAJECTORY_KEY, row_key


@dataclass(frozen=True, order=True)
class Trajectory:
    """One trajectory per item: a boundary state built one way, and its continuation."""

    checkpoint: str
    construction: str  # live, incremental, prefill or chunked:N
    precision: str
    prefix_precision: str  # the precision of the live run whose prefix it rebuilds (its own, for live)
    replica: int

    def fields(self) -> tuple:
        """(checkpoint, construction, precision, prefix_precision, replica), as the layout takes them."""
        return astuple(self)

    @classmethod
    def of_row(cls, row: dict) -> Trajectory:
        """The trajectory a ledger row (trajectories, transplants) belongs to."""
        return cls(row["checkpoint"], row["construction"], row["precision"], row["prefix_precision"], row["replica"])

    def label(self) -> str:
        """How the comparison table and the card name it within its checkpoint: live/bf16/rep0, prefill/fp32/rep0<-bf16."""
        source = "" if self.construction == "live" else f"<-{self.prefix_precision}"
        return f"{self.construction}/{self.precision}/rep{self.replica}{source}"

    def key(self, item_id: str) -> tuple:
        """The TRAJECTORY_KEY of this trajectory's row for one item."""
        return row_key({**asdict(self), "item_id": item_id}, TRAJECTORY_KEY)


def trajectory_label(row: dict) -> str:
    """The label of the trajectory a ledger row belongs to (Trajectory.label)."""
    return Trajectory.of_row(row).label()


@dataclass(frozen=True)
class Comparison:
    """Two trajectories of one checkpoint compared item by item (experiments.compare): an experiment's pair."""

    experiment: str  # E1, E2 or E3
    relation: str  # construction (two ways to one boundary) or replica (the same way, in another process)
    a: Trajectory
    b: Trajectory


@dataclass(frozen=True)
class TransplantJob:
    """One transplant job (over every shard): caches swapped between the trajectories of each pair."""

    selection: str
    checkpoint: str
    precision: str
    pairs: tuple[tuple[Trajectory, Trajectory], ...]  # (donor, recipient), in the order the job runs them
    sweep: bool  # the selected set also tries the sweep's partial transplants


@dataclass(frozen=True)
class JobList:
    primary: str
    e1: str
    replications: tuple[str, ...]  # checkpoints besides the primary one (the outcome-blind one's)
    trajectories: tuple[Trajectory, ...]  # sorted, each once
    transplants: tuple[TransplantJob, ...]
    comparisons: tuple[Comparison, ...]  # in the comparison table's order

    def of(self, checkpoint: str) -> list[Trajectory]:
        return [trajectory for trajectory in self.trajectories if trajectory.checkpoint == checkpoint]

    def transplant(self, selection: str, checkpoint: str, precision: str) -> TransplantJob:
        for job in self.transplants:
            if (job.selection, job.checkpoint, job.precision) == (selection, checkpoint, precision):
                return job
        raise KeyError(f"no transplant job {selection}/{checkpoint}/{precision} in this design")

    def e1_pair(self, checkpoint: str) -> tuple[Trajectory, Trajectory]:
        """E1's live and prefill trajectories (replica 0): what transplant selection reads."""
        return live(checkpoint, self.e1), rebuilt(checkpoint, self.e1, self.e1, "prefill")


def live(checkpoint: str, precision: str, replica: int = 0) -> Trajectory:
    return Trajectory(checkpoint, "live", precision, precision, replica)


def rebuilt(checkpoint: str, prefix_precision: str, precision: str, construction: str, replica: int = 0) -> Trajectory:
    return Trajectory(checkpoint, construction, precision, prefix_precision, replica)


def comparisons(
    checkpoint: str, e1: str, replicas: int, precisions: list[str], constructions: list[str]
) -> list[Comparison]:
    """The pairs of one checkpoint, in the comparison table's order: E1 (live against prefill at the E1
    precision, each side against its replicas), E2 (at each precision, incremental against every other
    construction over the E1 live prefix), E3 (at each precision, its live cache against incremental over
    its own prefix)."""
    pairs = [Comparison("E1", "construction", live(checkpoint, e1), rebuilt(checkpoint, e1, e1, "prefill"))]
    for replica in range(1, replicas):
        pairs.append(Comparison("E1", "replica", live(checkpoint, e1), live(checkpoint, e1, replica)))
        pairs.append(
            Comparison(
                "E1",
                "replica",
                rebuilt(checkpoint, e1, e1, "prefill"),
                rebuilt(checkpoint, e1, e1, "prefill", replica),
            )
        )
    for precision in precisions:
        for construction in constructions:
            if construction != "incremental":
                incremental = rebuilt(checkpoint, e1, precision, "incremental")
                pairs.append(
                    Comparison("E2", "construction", incremental, rebuilt(checkpoint, e1, precision, construction))
                )
    for precision in precisions:
        own = rebuilt(checkpoint, precision, precision, "incremental")
        pairs.append(Comparison("E3", "construction", live(checkpoint, precision), own))
    return pairs


def replication_comparisons(checkpoint: str, e1: str) -> list[Comparison]:
    """The pairs of another checkpoint: only E1 live against prefill, the sides its replication runs."""
    return comparisons(checkpoint, e1, 1, [], [])


def outcome_blind_checkpoint(config: dict) -> str:
    """E5's outcome-blind replication's checkpoint: the one configured, else the primary."""
    return config["transplant"]["outcome_blind"]["checkpoint"] or next(iter(config["checkpoints"]))


def job_list(config: dict) -> JobList:
    """Every trajectory and transplant job of a resolved config."""
    primary = next(iter(config["checkpoints"]))
    e1 = config["matched"]["precision"]
    replicas = config["matched"]["replicas"]
    fixed = config["fixed_prefix"]
    transplant = config["transplant"]
    blind = outcome_blind_checkpoint(config)
    replications = (blind,) if transplant["enabled"] and blind != primary else ()

    trajectories = {live(primary, e1, r) for r in range(replicas)}  # E1
    trajectories |= {rebuilt(primary, e1, e1, "prefill", r) for r in range(replicas)}
    trajectories |= {rebuilt(primary, e1, p, c) for p in fixed["precisions"] for c in fixed["constructions"]}  # E2
    trajectories |= {live(primary, p) for p in fixed["precisions"]}  # E3
    trajectories |= {rebuilt(primary, p, p, "incremental") for p in fixed["precisions"]}
    for checkpoint in replications:
        trajectories |= {live(checkpoint, e1), rebuilt(checkpoint, e1, e1, "prefill")}

    transplants = []
    if transplant["enabled"]:
        both_ways = lambda pairs: (*pairs, *((recipient, donor) for donor, recipient in pairs))  # noqa: E731
        pair = (live(primary, e1), rebuilt(primary, e1, e1, "prefill"))
        transplants.append(TransplantJob("selected", primary, e1, both_ways((pair,)), sweep=True))
        blind_pair = (live(blind, e1), rebuilt(blind, e1, e1, "prefill"))
        transplants.append(TransplantJob("outcome_blind", blind, e1, both_ways((blind_pair,)), sweep=False))
        cross = transplant["cross_precision"]
        if cross:
            # E1-precision caches cast up into the other precision's continuation, and back.
            up = (
                (live(primary, e1), rebuilt(primary, e1, cross, "incremental")),
                (rebuilt(primary, e1, e1, "prefill"), rebuilt(primary, e1, cross, "prefill")),
            )
            down = tuple((recipient, donor) for donor, recipient in up)
            transplants.append(TransplantJob("cross_precision", primary, cross, up, sweep=False))
            transplants.append(TransplantJob("cross_precision", primary, e1, down, sweep=False))
    pairs = comparisons(primary, e1, replicas, fixed["precisions"], fixed["constructions"])
    for checkpoint in replications:
        pairs += replication_comparisons(checkpoint, e1)
    return JobList(primary, e1, replications, tuple(sorted(trajectories)), tuple(transplants), tuple(pairs))


def sweep_subsets(sweep: dict, layers: int) -> int:
    """Partial transplants the sweep tries per selected item and direction, besides all layers."""
    single = sweep["single_layers"]
    singles = layers if single == "all" else 0 if single == "none" else len(single)
    return singles + 2 * len(sweep["block_sizes"]) + 2 * sweep["kv_only"] + len(sweep["windows"])
