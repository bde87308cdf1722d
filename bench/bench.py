"""Where the time goes: a benchmark that prints a table (never a timed test).

    .venv/bin/python bench/bench.py --ledger ledger                 # after `snakemake --cores 2`
    .venv/bin/python bench/bench.py --ledger ledger --only d,e      # some sections

It reads a completed ledger of the default config (it never reruns the default
config) and measures:

  (a) forward tokens executed vs the minimum the design needs: one shard of each
      model-job kind is re-executed with every model forward counted, and its rows
      are checked against the ledger's fingerprints
  (b) model work (the rows' model_seconds) vs the whole job (Snakemake's benchmarks/*.tsv)
  (c) decode tokens/s: our continuation loop vs model.generate on the same tokens
  (d) fingerprint GB/s vs raw xxh3_128 over the same bytes
  (e) model load: the converted safetensors folder vs the GGUF
  (f) snakemake --dry-run and a no-op rerun on a complete 200-item ledger
      (bench/config_200.yaml, a tiny random Qwen2; built on first use)
  (g) the rehearsal: the paper's full design (E1-E5, audit, report) from scratch at 50, 100 and
      200 items (bench/config_rehearsal.yaml, the tiny diverging test model, small budgets), wall
      time per stage, so a stage that grows faster than the item count shows (--rehearsal 50,100)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

from stagereplay.design.schema import load_config
from stagereplay.ledger.layout import LedgerLayout

REPO = Path(__file__).resolve().parents[1]
SECTIONS = "abcdefg"
rows: list[tuple[str, str, str, str]] = []  # (section, measurement, value, reference or note)


def add(section: str, measurement: str, value: str, note: str = "") -> None:
    rows.append((section, measurement, value, note))
    print(f"  ({section}) {measurement}: {value}{'  — ' + note if note else ''}", file=sys.stderr, flush=True)


def best_of(function, repeats: int = 3) -> tuple[float, object]:
    """Fastest of a few runs: on a shared machine the minimum is the least disturbed."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    return best, result


class RunLedger:
    """A completed ledger of one config: its paths come from stagereplay.ledger.layout, as the workflow's do."""

    def __init__(self, root: Path, config: dict):
        self.root, self.config, self.layout = root, config, LedgerLayout(root)
        self.checkpoint = next(iter(config["checkpoints"]))
        self.e1 = config["matched"]["precision"]
        if not Path(self.layout.summary).is_file():
            sys.exit(
                f"bench: {self.layout.summary} not found — run the workflow to the end first (snakemake --cores 2)"
            )

    def live(self, precision: str, shard: str = "000", replica: int = 0) -> Path:
        return Path(self.layout.live_table(self.checkpoint, precision, replica, shard))

    def rebuilt(self, precision: str, construction: str, shard: str = "000", replica: int = 0) -> Path:
        return Path(self.layout.rebuilt_table(self.checkpoint, self.e1, precision, construction, replica, shard))

    @property
    def model_record(self) -> Path:
        return Path(self.layout.model_record(self.checkpoint))

    def record(self) -> dict:
        from stagereplay.inputs.checkpoints import read_model_record

        return read_model_record(self.model_record)

    def load(self, precision: str):
        """The checkpoint's engine at ``precision``, loaded as the model jobs load it."""
        from stagereplay.engines.registry import load_checkpoint

        return load_checkpoint(self.record(), self.runtime(precision))

    def runtime(self, precision: str):
        from stagereplay.engines.base import Runtime

        rt = self.config["runtime"]
        return Runtime(
            precision=precision,
            device=rt["device"],
            threads=rt["threads"],
            attn_implementation=rt["attn_implementation"],
        )

    def spec(self, precision: str, shard: int = 0, replica: int = 0):
        from stagereplay.experiments.job import ShardSpec

        return ShardSpec(self.checkpoint, precision, replica, shard, self.config["shard_size"])

    def job_context(self, precision: str, store: Path, out: Path, **options):
        """The context of a model job on shard 000 at ``precision`` that writes to ``store`` and ``out``.

        Its store_caches is ``all``: the live and rebuild jobs store their caches, a transplant stores none it
        rebuilt, whatever the ledger's policy (the store is a scratch copy the bench throws away).
        """
        from stagereplay.experiments.job import JobContext

        return JobContext.read(
            self.model_record,
            runtime=self.runtime(precision),
            shard_spec=self.spec(precision),
            items_path=self.layout.items,
            suffix_tokens=self.config["stage"]["suffix_tokens"],
            store_root=store,
            out_path=out,
            store_caches="all",
            **options,
        )


# ---------------------------------------------------------------- (a) forward tokens


def minimum_tokens(row: dict) -> int:
    """Forward positions a trajectory row needs: the boundary cache, the pending token, the suffix but its last token."""
    if row["boundary_reason"] == "eos":  # nothing is continued
        return row["prefix_length"] - 1
    return row["prefix_length"] - 1 + len(row["suffix_tokens"])


def experiments_using(row: dict, e1: str) -> set[str]:
    """Which of E1, E2, E3 read this trajectory (the pairs of stagereplay.experiments.compare)."""
    used = set()
    construction, precision, prefix = row["construction"], row["precision"], row["prefix_precision"]
    if precision == e1 and prefix == e1 and construction in ("live", "prefill"):
        used.add("E1")
    if prefix == e1 and construction != "live" and row["replica"] == 0:
        used.add("E2")
    if prefix == precision and construction in ("live", "incremental") and row["replica"] == 0:
        used.add("E3")
    return used or {"other"}


def transplant_minimum(row: dict) -> int:
    return len(row["suffix_tokens"])  # the pending token, then every emitted token but the last


class ForwardCounter:
    """Counts every position fed through the checkpoint's engine's forward, its one entry point to the model."""

    def __init__(self, record: dict):
        from stagereplay.engines.registry import engine_class

        self.engine_class = engine_class(record)
        self.original, self.counts = self.engine_class.forward, Counter()

    def __enter__(self):
        def counting(engine, tokens, cache):
            self.counts["calls"] += 1
            self.counts["tokens"] += len(tokens)
            return self.original(engine, tokens, cache)

        self.engine_class.forward = counting
        return self.counts

    def __exit__(self, *exc):
        self.engine_class.forward = self.original


def fingerprints(rows_: list[dict], keys=("prefix_object", "cache_object", "suffix_object")) -> list[tuple]:
    return [tuple(row.get(key) for key in keys) for row in rows_]


def section_a(ledger: RunLedger) -> None:
    from stagereplay.experiments.constructions import StageBoundary
    from stagereplay.experiments.shards import run_construction_shard, run_live_shard
    from stagereplay.experiments.transplant_job import TransplantJob, run_transplant_shard
    from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA, read_table

    trajectories = read_table(ledger.layout.table("trajectories"), TRAJECTORY_SCHEMA).to_pylist()
    transplants_path = Path(ledger.layout.table("transplants"))
    transplants = read_table(transplants_path, TRANSPLANT_SCHEMA).to_pylist() if transplants_path.exists() else []
    keys = Counter(
        (r["checkpoint"], r["precision"], r["construction"], r["replica"], r["prefix_precision"], r["item_id"])
        for r in trajectories
    )
    duplicates = sum(count - 1 for count in keys.values())
    by_kind = Counter()
    for row in trajectories:
        by_kind["live" if row["construction"] == "live" else "rebuild"] += minimum_tokens(row)
    by_kind["transplant"] = sum(transplant_minimum(row) for row in transplants)
    total = sum(by_kind.values())
    add(
        "a",
        "design minimum, whole ledger",
        f"{total:,} forward tokens",
        f"{len(trajectories)} trajectories ({duplicates} duplicated), {len(transplants)} transplants; "
        + ", ".join(f"{kind} {tokens:,}" for kind, tokens in by_kind.items()),
    )
    uses = Counter()
    for row in trajectories:
        uses[id(row)] = len(experiments_using(row, ledger.e1))
    standalone = sum(minimum_tokens(row) * uses[id(row)] for row in trajectories) + by_kind["transplant"]
    shared = sum(1 for row in trajectories if uses[id(row)] > 1)
    add(
        "a",
        "if each experiment computed its own trajectories",
        f"{standalone:,} forward tokens",
        f"{shared} trajectories serve more than one of E1/E2/E3 and are computed once: "
        f"{1 - total / standalone:.0%} of the work saved",
    )

    stage = ledger.config["stage"]
    boundary = StageBoundary(stage["max_new_tokens"], stage["marker"])
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # A hard-linked copy of the store: the re-executed shards read the saved prefixes and
        # caches from it and write their objects there, never into the ledger.
        store = Path(LedgerLayout(scratch).objects)
        shutil.copytree(ledger.layout.objects, store, copy_function=os.link)
        prompts = ledger.layout.prompts(ledger.checkpoint)
        jobs = {
            "live": lambda: run_live_shard(
                ledger.job_context(ledger.e1, store, scratch / "live.parquet", prompts_path=prompts), boundary
            ),
            "rebuild": lambda: run_construction_shard(
                ledger.job_context(ledger.e1, store, scratch / "rebuild.parquet", prompts_path=prompts),
                ledger.live(ledger.e1),
                "prefill",
            ),
        }
        reference = {"live": ledger.live(ledger.e1), "rebuild": ledger.rebuilt(ledger.e1, "prefill")}
        if transplants:
            selection = json.loads(Path(ledger.layout.selection).read_text())
            live, prefill = str(ledger.live(ledger.e1)), str(ledger.rebuilt(ledger.e1, "prefill"))
            job = TransplantJob(
                "outcome_blind",
                frozenset(selection["outcome_blind"]["item_ids"]),
                ((live, prefill), (prefill, live)),
                None,
            )
            jobs["transplant"] = lambda: run_transplant_shard(
                ledger.job_context(ledger.e1, store, scratch / "transplant.parquet"), job
            )
            reference["transplant"] = Path(
                ledger.layout.transplant_table("outcome_blind", ledger.checkpoint, ledger.e1, "000")
            )
        for kind, run in jobs.items():
            with ForwardCounter(ledger.record()) as counts:
                started = time.perf_counter()
                out = run()
                seconds = time.perf_counter() - started
            import pyarrow.parquet as pq

            again = pq.read_table(out).to_pylist()
            saved = pq.read_table(reference[kind]).to_pylist()
            if kind == "transplant":
                saved = [row for row in saved if row["item_id"] in job.item_ids]
                minimum = sum(transplant_minimum(row) for row in again)
                same = fingerprints(again, ("item_id", "subset", "cache_digest", "suffix_object")) == fingerprints(
                    saved, ("item_id", "subset", "cache_digest", "suffix_object")
                )
            else:
                minimum = sum(minimum_tokens(row) for row in again)
                same = fingerprints(again) == fingerprints(saved)
            add(
                "a",
                f"{kind} shard 000 re-executed",
                f"{counts['tokens']:,} executed / {minimum:,} minimum ({counts['tokens'] / minimum:.3f}x)",
                f"{counts['calls']:,} forward calls, {len(again)} rows in {seconds:.0f} s; "
                f"fingerprints {'match the ledger' if same else 'DIFFER from the ledger'}",
            )


# ---------------------------------------------------------------- (b) model work vs job


def section_b(ledger: RunLedger) -> None:
    import pyarrow.parquet as pq

    jobs = []
    for tsv in ledger.layout.job_benchmarks():
        table = Path(ledger.layout.benchmarked_table(tsv))
        kind = ledger.layout.job_kind(table)
        if not table.exists() or kind == "transplant":
            continue  # transplant rows carry no model_seconds
        wall = float(tsv.read_text().splitlines()[1].split("\t")[0])
        cpu = float(tsv.read_text().splitlines()[1].split("\t")[-1])
        model = sum(pq.read_table(table, columns=["model_seconds"]).column("model_seconds").to_pylist())
        jobs.append((kind, wall, cpu, model, pq.read_metadata(table).num_rows))
    if not jobs:
        add("b", "model work vs job", "no benchmarks/*.tsv with a shard table", "run the workflow first")
        return
    wall = sum(job[1] for job in jobs)
    model = sum(job[3] for job in jobs)
    cpu = sum(job[2] for job in jobs)
    add(
        "b",
        f"model work / job wall, {len(jobs)} live+rebuild jobs",
        f"{model:,.0f} s / {wall:,.0f} s = {model / wall:.1%}",
        f"overhead {1 - model / wall:.1%} (target < 5%); job CPU time {cpu:,.0f} s = {cpu / wall:.0%} of wall "
        "(below 100%: the job waited for a core)",
    )
    per_item = model / sum(job[4] for job in jobs)
    overhead_per_job = (wall - model) / len(jobs)
    add(
        "b",
        "per job: overhead, model work per item",
        f"{overhead_per_job:.1f} s, {per_item:.1f} s",
        f"{ledger.config['shard_size']} items per job; overhead = start-up, imports, model load, hashing, I/O",
    )

    # What the overhead is made of, measured now in a fresh interpreter each.
    probe = "import time; t=time.perf_counter(); import stagereplay.cli, stagereplay.experiments.shards; print(time.perf_counter()-t)"
    started = time.perf_counter()
    imports = float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    interpreter = time.perf_counter() - started
    add(
        "b",
        "  of which: python start + imports (torch, transformers)",
        f"{interpreter:.1f} s",
        f"imports alone {imports:.1f} s",
    )
    seconds, _ = best_of(lambda: ledger.load(ledger.e1), repeats=2)
    add("b", "  of which: model load from the converted folder", f"{seconds:.1f} s")
    seconds, stored = store_shard_again(ledger)
    add(
        "b",
        "  of which: fingerprint + store one shard's caches and tokens",
        f"{seconds:.2f} s",
        f"{stored / 1e6:.1f} MB",
    )


def store_shard_again(ledger: RunLedger) -> tuple[float, int]:
    """Fingerprint and store again every artifact of one live shard, into a scratch store."""
    import pyarrow.parquet as pq

    from stagereplay.ledger.fingerprint import fingerprint_cache
    from stagereplay.ledger.kvstate import KVState
    from stagereplay.ledger.store import ObjectStore

    source = ObjectStore(ledger.layout.objects)
    shard = pq.read_table(ledger.live(ledger.e1)).to_pylist()
    states = [KVState.from_named_tensors(source.get(row["cache_object"])) for row in shard]
    tokens = [(source.get_tokens(row["prefix_object"]), row["suffix_tokens"]) for row in shard]
    nbytes = sum(t.numel() * t.element_size() for state in states for t in state.keys + state.values)
    with tempfile.TemporaryDirectory() as scratch:
        store = ObjectStore(scratch)
        started = time.perf_counter()
        for state, (prefix, suffix) in zip(states, tokens):
            digest = fingerprint_cache(state).digest
            store.put(state.named_tensors(), {"kind": "kv_cache"}, object_id=digest)
            store.put_tokens(prefix)
            store.put_tokens(suffix)
        return time.perf_counter() - started, nbytes


# ---------------------------------------------------------------- (c) decode loop vs generate


def section_c(ledger: RunLedger) -> None:
    import pyarrow.parquet as pq
    import torch

    from stagereplay.experiments.constructions import build_boundary_state
    from stagereplay.experiments.decode import continue_from
    from stagereplay.ledger.store import ObjectStore

    row = pq.read_table(ledger.live(ledger.e1)).to_pylist()[0]
    prefix = ObjectStore(ledger.layout.objects).get_tokens(row["prefix_object"])
    steps = ledger.config["stage"]["suffix_tokens"]
    for precision in sorted({ledger.e1, "fp32"}):
        engine = ledger.load(precision)
        state = build_boundary_state(engine, prefix, "prefill", row["prompt_length"])

        def ours(engine=engine, state=state):
            return list(continue_from(engine, state, prefix[-1], steps, frozenset()).tokens)

        def generate(engine=engine, state=state):
            ids = torch.tensor([prefix])
            # The cache holds prefix[:-1]; generate feeds only the uncached pending token first.
            output = engine.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=engine.to_cache(state),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
            )
            return output[0, len(prefix) :].tolist()

        ours_s, ours_tokens = best_of(ours)
        generate_s, generate_tokens = best_of(generate)
        add(
            "c",
            f"decode {precision}, {steps} tokens after a {len(prefix)}-token prefix",
            f"ours {steps / ours_s:.1f} tok/s vs generate {steps / generate_s:.1f} tok/s (ours takes {ours_s / generate_s:.2f}x)",
            f"same tokens: {'yes' if ours_tokens == generate_tokens else 'NO'}; ours also records each margin",
        )


# ---------------------------------------------------------------- (d) fingerprint throughput


def section_d(ledger: RunLedger) -> None:
    import pyarrow.parquet as pq
    import torch
    import xxhash

    from stagereplay.ledger.fingerprint import fingerprint_cache, fingerprint_tensor, tensor_buffer
    from stagereplay.ledger.kvstate import KVState
    from stagereplay.ledger.store import ObjectStore

    big = torch.randn(64, 1024, 1024).to(torch.bfloat16)  # 128 MiB
    buffer = memoryview(big.view(torch.uint8).numpy()).cast("B")
    size = big.numel() * big.element_size()
    fingerprint_tensor(big)  # warm: the first pass over fresh memory pays its page faults
    raw_s, _ = best_of(lambda: xxhash.xxh3_128(buffer).hexdigest(), repeats=5)
    ours_s, _ = best_of(lambda: fingerprint_tensor(big), repeats=5)
    raw_s = min(raw_s, best_of(lambda: xxhash.xxh3_128(buffer).hexdigest(), repeats=5)[0])  # both sides alike
    add(
        "d",
        "fingerprint_tensor, one 128 MiB bf16 tensor",
        f"{size / ours_s / 1e9:.2f} GB/s",
        f"raw xxh3_128 over the same buffer {size / raw_s / 1e9:.2f} GB/s ({ours_s / raw_s:.2f}x its time)",
    )

    row = pq.read_table(ledger.live(ledger.e1)).to_pylist()[0]
    state = KVState.from_named_tensors(ObjectStore(ledger.layout.objects).get(row["cache_object"]))
    tensors = state.keys + state.values
    size = sum(t.numel() * t.element_size() for t in tensors)

    def raw():
        hasher = xxhash.xxh3_128()
        for tensor in tensors:
            hasher.update(tensor_buffer(tensor))
        return hasher.hexdigest()

    raw_s, _ = best_of(raw, repeats=20)
    ours_s, _ = best_of(lambda: fingerprint_cache(state), repeats=20)
    add(
        "d",
        f"fingerprint_cache, a boundary cache ({state.num_layers} layers, {state.num_positions} positions, "
        f"{size / 1e6:.1f} MB)",
        f"{size / ours_s / 1e9:.2f} GB/s",
        f"raw xxh3_128 over the same bytes {size / raw_s / 1e9:.2f} GB/s ({ours_s / raw_s:.2f}x its time)",
    )


# ---------------------------------------------------------------- (e) model load


def section_e(ledger: RunLedger) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder_s, _ = best_of(lambda: ledger.load(ledger.e1), repeats=3)
    gguf = Path(ledger.layout.embedded_gguf)
    if not gguf.is_file():
        add("e", "model load", f"folder {folder_s:.1f} s", f"no {gguf} to compare with")
        return

    def from_gguf():
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)

    gguf_s, _ = best_of(from_gguf, repeats=1)
    add(
        "e",
        f"model load, {ledger.e1}",
        f"converted folder {folder_s:.1f} s vs GGUF {gguf_s:.1f} s ({gguf_s / folder_s:.0f}x)",
        "the GGUF is dequantized once by convert_gguf; every job then loads the folder",
    )


# ---------------------------------------------------------------- (f) snakemake planning


def snakemake(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), *args]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    return time.perf_counter() - started, result


def section_f(ledger_200: Path, config_200: Path) -> None:
    config = ["--configfile", str(config_200), "--config", f"ledger_dir={ledger_200}"]
    if not Path(LedgerLayout(ledger_200).summary).is_file():
        print(f"  (f) building the 200-item ledger in {ledger_200} (once)...", file=sys.stderr, flush=True)
        seconds, result = snakemake(*config, "--cores", str(os.cpu_count() or 2))
        if result.returncode != 0:
            sys.exit(f"bench: building {ledger_200} failed:\n{result.stderr[-3000:]}")
        add("f", "building the 200-item ledger (tiny random Qwen2)", f"{seconds:.0f} s")
    jobs = len(LedgerLayout(ledger_200).shard_tables())
    timings = {}
    for label, extra in (("dry-run", ("--dry-run",)), ("no-op rerun", ("--cores", "2"))):
        samples = []
        for _ in range(3):
            seconds, result = snakemake(*config, *extra)
            if result.returncode != 0 or "Nothing to be done" not in result.stdout + result.stderr:
                sys.exit(
                    f"bench: {label} on {ledger_200} did not report 'Nothing to be done':\n{result.stderr[-3000:]}"
                )
            samples.append(seconds)
        timings[label] = statistics.median(samples)
    add(
        "f",
        f"snakemake --dry-run, complete 200-item ledger ({jobs} job outputs)",
        f"{timings['dry-run']:.1f} s",
        "median of 3; includes interpreter start and config/item validation",
    )
    add("f", "no-op rerun (snakemake --cores 2), same ledger", f"{timings['no-op rerun']:.1f} s", "median of 3")


# Each stage is one snakemake invocation that stops before the next stage's rules (--omit-from),
# so its wall time less a dry run's (parsing and planning, measured first) is the stage's work.
REHEARSAL_STAGES = (  # (stage, targets, options)
    ("parse", (), ("--dry-run",)),
    ("model jobs", (), ("--omit-from", "gather", "gather_transplants")),
    ("gather", (), ("--omit-from", "compare", "summary")),
    ("compare", (), ("--omit-from", "summary")),
    ("summary", (), ("--omit-from", "report")),
    ("report", (), ()),
    ("audit", (), ("--config", "mode=audit", "--omit-from", "report")),  # E4: the run's design recomputed
    ("report with E4", (), ("--config", "mode=audit")),
)


def rehearsal_items(count: int, workdir: Path) -> str:
    """data/items.jsonl when it holds enough items, else the built-in generator's."""
    source = REPO / "data/items.jsonl"
    if sum(1 for line in source.read_text().splitlines() if line.strip()) >= count:
        return str(source)
    generated = workdir / f"items-{count}.jsonl"
    subprocess.run(
        [sys.executable, "-m", "stagereplay", "make-default-items", "--n", str(count), "--out", str(generated)],
        check=True,
    )
    return str(generated)


def section_g(counts: list[int], root: Path, cores: int) -> None:
    base = yaml.safe_load((REPO / "bench/config_rehearsal.yaml").read_text())
    table: dict[str, dict[int, float]] = {}
    for count in counts:
        ledger = root / f"items-{count}"
        if ledger.exists():
            shutil.rmtree(ledger)  # from scratch: every stage runs
        ledger.mkdir(parents=True)
        config = ledger.parent / f"config-{count}.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    **base,
                    "ledger_dir": str(ledger),
                    "items": {**base["items"], "limit": count, "source": rehearsal_items(count, ledger.parent)},
                }
            )
        )
        parse = 0.0
        for stage, targets, options in REHEARSAL_STAGES:
            run = () if stage == "parse" else ("--cores", str(cores))
            seconds, result = snakemake(*targets, "--configfile", str(config), *run, *options)
            if result.returncode != 0:
                sys.exit(f"bench: rehearsal stage {stage} at {count} items failed:\n{result.stderr[-3000:]}")
            if stage == "parse":
                parse = seconds
            table.setdefault(stage, {})[count] = seconds if stage == "parse" else max(seconds - parse, 0.0)
            print(f"  (g) {count} items, {stage}: {table[stage][count]:.1f} s", file=sys.stderr, flush=True)
    first, last = counts[0], counts[-1]
    for stage, by_count in table.items():
        values = ", ".join(f"{count}: {by_count[count]:.1f} s" for count in counts)
        note = ""
        if last > first and by_count[first] > 0:
            growth = by_count[last] / by_count[first]
            note = f"x{growth:.1f} for x{last / first:.0f} items" + (
                " — faster than linear" if growth > 1.25 * last / first else ""
            )
        add("g", f"rehearsal: {stage} (wall s at {', '.join(map(str, counts))} items)", values, note)


# ---------------------------------------------------------------- table


def machine() -> str:
    from stagereplay.engines.cpuinfo import cpu_model

    model = cpu_model()
    import torch
    import transformers

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; load average {load}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", type=Path, default=REPO / "ledger", help="completed ledger of --config")
    parser.add_argument("--config", type=Path, default=REPO / "config/config.yaml", help="the config that ledger ran")
    parser.add_argument(
        "--ledger-200",
        type=Path,
        default=REPO / "ledger/bench-200",
        help="complete 200-item ledger for (f); built from --config-200 if missing",
    )
    parser.add_argument("--config-200", type=Path, default=REPO / "bench/config_200.yaml")
    parser.add_argument("--only", default=SECTIONS, help="sections to run, e.g. a,c,d (default: all)")
    parser.add_argument("--rehearsal", default="50,100,200", help="item counts of the rehearsal (g)")
    parser.add_argument(
        "--rehearsal-dir", type=Path, default=REPO / "ledger/rehearsal", help="ledgers of (g), rebuilt each time"
    )
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="snakemake --cores of (g)")
    args = parser.parse_args(argv)
    wanted = set(args.only.replace(",", "")) & set(SECTIONS)
    import torch

    torch.set_num_threads(1)  # the jobs' thread count in the default config
    before = machine()
    print(f"machine: {before}", file=sys.stderr)
    ledger = RunLedger(args.ledger.resolve(), load_config(args.config)) if wanted - {"f", "g"} else None
    for section in SECTIONS:
        if section in wanted:
            started = time.perf_counter()
            if section == "f":
                section_f(args.ledger_200.resolve(), args.config_200.resolve())
            elif section == "g":
                counts = sorted(int(count) for count in args.rehearsal.split(","))
                section_g(counts, args.rehearsal_dir.resolve(), args.cores)
            else:
                globals()[f"section_{section}"](ledger)
            print(f"  ({section}) took {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(f"\nmachine: {before}\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| | measurement | value | reference / note |\n|---|---|---|---|")
    for section, measurement, value, note in rows:
        print(f"| ({section}) | {measurement} | {value} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
