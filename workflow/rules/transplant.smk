# E5 (transplant): swap boundary caches between live and prefill on divergent
# items, in both directions; sweep layer subsets, K/V and positions on the
# selected set; repeat all layers on an outcome-blind sample; and cast caches
# across precisions. Model jobs are shards, like every other model job.

TRANSPLANT = config["transplant"]
SWEEP = TRANSPLANT["sweep"]
BLIND = TRANSPLANT["outcome_blind"]
BLIND_CHECKPOINT = BLIND["checkpoint"] or PRIMARY
CROSS = TRANSPLANT["cross_precision"]


localrules:
    select_transplants,  # reads the E1 shard tables and writes a small JSON: no cluster job


def outcome_blind_ids():
    from stagereplay.plan import outcome_blind_sample

    try:
        return outcome_blind_sample([item.item_id for item in ITEMS], BLIND["sample"], BLIND["seed"])
    except ValueError as error:
        raise WorkflowError(str(error)) from None


if TRANSPLANT["enabled"]:
    if BLIND_CHECKPOINT not in CHECKPOINTS:
        raise WorkflowError(
            f"transplant.outcome_blind.checkpoint {BLIND_CHECKPOINT!r} is not in checkpoints — add it there or fix the name"
        )
    if CROSS and CROSS == MATCHED["precision"]:
        raise WorkflowError("transplant.cross_precision must differ from matched.precision — use e.g. fp32 with a bf16 E1")
    BLIND_IDS = outcome_blind_ids()
    _layers_file = Path(model_folder(PRIMARY), "config.json")
    if _layers_file.is_file():
        # The model is known already (a folder, or converted by an earlier run): check the sweep now,
        # so a bad layer choice fails before any job and the existing ledger stays as it was.
        from stagereplay.plan import SweepPlan, TransplantError, check_plan

        try:
            check_plan(
                SweepPlan(SWEEP["single_layers"], tuple(SWEEP["block_sizes"]), SWEEP["kv_only"], tuple(SWEEP["windows"])),
                json.loads(_layers_file.read_text()).get("num_hidden_layers", 0),
            )
        except TransplantError as error:
            raise WorkflowError(str(error)) from None


def sweep_args():
    args = ["--sweep", f"--single-layers {','.join(map(str, SWEEP['single_layers'])) if isinstance(SWEEP['single_layers'], list) else SWEEP['single_layers']}"]
    if SWEEP["block_sizes"]:
        args.append("--block-sizes " + " ".join(map(str, SWEEP["block_sizes"])))
    if SWEEP["kv_only"]:
        args.append("--kv-only")
    if SWEEP["windows"]:
        args.append("--windows " + " ".join(map(str, SWEEP["windows"])))
    return " ".join(args)


def transplant_pairs(wildcards):
    """(donor, recipient) shard tables of one transplant job, both directions."""
    E1 = MATCHED["precision"]
    name, precision, shard = wildcards.checkpoint, wildcards.precision, wildcards.shard
    live = lambda p: live_table(name, p, 0, shard)  # noqa: E731
    rebuilt = lambda p, c: rebuilt_table(name, E1, p, c, 0, shard)  # noqa: E731
    if wildcards.selection in ("selected", "outcome_blind"):
        pairs = [(live(E1), rebuilt(E1, "prefill"))]
    elif precision == CROSS:  # E1-precision caches cast up into the other precision's continuation
        pairs = [(live(E1), rebuilt(CROSS, "incremental")), (rebuilt(E1, "prefill"), rebuilt(CROSS, "prefill"))]
    else:  # and back
        pairs = [(rebuilt(CROSS, "incremental"), live(E1)), (rebuilt(CROSS, "prefill"), rebuilt(E1, "prefill"))]
    if wildcards.selection != "cross_precision":
        pairs += [(recipient, donor) for donor, recipient in pairs]
    return pairs


rule select_transplants:
    input:
        live=[live_table(PRIMARY, MATCHED["precision"], 0, shard) for shard in SHARDS],
        prefill=[rebuilt_table(PRIMARY, MATCHED["precision"], MATCHED["precision"], "prefill", 0, shard) for shard in SHARDS],
    output:
        ledger("transplants", "selection.json"),
    params:
        first_k=f"--first-k {TRANSPLANT['selected']['first_k']}" if TRANSPLANT["selected"]["first_k"] else "",
        blind=lambda wildcards: " ".join(BLIND_IDS),
        blind_checkpoint=BLIND_CHECKPOINT,
        seed=BLIND["seed"],
    log:
        ledger("logs", "select_transplants.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "{STAGEREPLAY} select-transplants --live {input.live:q} --prefill {input.prefill:q} {params.first_k}"
        " --outcome-blind-checkpoint {params.blind_checkpoint} --outcome-blind-ids {params.blind} --seed {params.seed}"
        " --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule transplant:
    input:
        model=ledger("models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        selection=ledger("transplants", "selection.json"),
        tables=lambda wildcards: sorted({path for pair in transplant_pairs(wildcards) for path in pair}),
    output:
        ledger("runs", "transplant", "{selection}", "{checkpoint}", "{precision}", "shard-{shard}.parquet"),
    wildcard_constraints:
        selection="selected|outcome_blind|cross_precision",
    params:
        runtime=lambda wildcards: runtime_args(wildcards, replica=0),
        pairs=lambda wildcards: " ".join(f"--pair {donor} {recipient}" for donor, recipient in transplant_pairs(wildcards)),
        sweep=lambda wildcards: sweep_args() if wildcards.selection == "selected" else "",
        store=ledger("objects"),
        source_store=ledger("objects"),
    log:
        ledger("logs", "transplant", "{selection}", "{checkpoint}", "{precision}", "shard-{shard}.log"),
    benchmark:
        ledger("benchmarks", "transplant", "{selection}", "{checkpoint}", "{precision}", "shard-{shard}.tsv")
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    shell:
        "{STAGEREPLAY} transplant --model-record {input.model:q} --items {input.item_file:q}"
        " --selection {wildcards.selection} --selection-file {input.selection:q} {params.pairs} {params.sweep}"
        " {params.runtime} --store {params.store:q} --source-store {params.source_store:q}"
        " --out {output:q} 2> {log:q} || {{ tail -n 1 {log:q} >&2; exit 1; }}"


def transplant_tables():
    if not TRANSPLANT["enabled"]:
        return []
    E1 = MATCHED["precision"]
    tables = [ledger("runs", "transplant", "selected", PRIMARY, E1, f"shard-{shard}.parquet") for shard in SHARDS]
    tables += [ledger("runs", "transplant", "outcome_blind", BLIND_CHECKPOINT, E1, f"shard-{shard}.parquet") for shard in SHARDS]
    if CROSS:
        tables += [
            ledger("runs", "transplant", "cross_precision", PRIMARY, precision, f"shard-{shard}.parquet")
            for precision in (CROSS, E1)
            for shard in SHARDS
        ]
    return tables
