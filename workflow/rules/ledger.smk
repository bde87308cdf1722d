# Gather every shard table into the ledger's Parquet tables, compare the pairs
# each experiment defines, then write the figures.


localrules:
    gather,
    gather_transplants,
    compare,
    summary,


# Checkpoints other than the primary one: only the outcome-blind replication's, with E1 live and prefill (rep0).
REPLICATIONS = [BLIND_CHECKPOINT] if TRANSPLANT["enabled"] and BLIND_CHECKPOINT != PRIMARY else []


def all_shard_tables():
    """Every trajectory table; transplant jobs add the outcome-blind checkpoint's E1 tables."""
    tables = matched_tables() + fixed_prefix_tables() + bridge_tables()
    tables += [
        table
        for checkpoint in REPLICATIONS
        for shard in SHARDS
        for table in (
            live_table(checkpoint, MATCHED["precision"], 0, shard),
            rebuilt_table(checkpoint, MATCHED["precision"], MATCHED["precision"], "prefill", 0, shard),
        )
    ]
    return sorted(set(tables))


rule gather:
    input:
        all_shard_tables(),
    output:
        ledger("tables", "trajectories.parquet"),
    log:
        ledger("logs", "gather.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{STAGEREPLAY} gather --out {output:q} {input:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule compare:
    input:
        rules.gather.output,
    output:
        ledger("tables", "comparisons.parquet"),
    params:
        store=ledger("objects"),
        primary=PRIMARY,
        replications=" ".join(REPLICATIONS),
        matched_precision=MATCHED["precision"],
        replicas=MATCHED["replicas"],
        precisions=" ".join(FIXED["precisions"]),
        constructions=" ".join(shlex.quote(name) for name in CONSTRUCTIONS),
    log:
        ledger("logs", "compare.log"),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "{STAGEREPLAY} compare --trajectories {input:q} --store {params.store:q}"
        " --primary {params.primary} --replications {params.replications}"
        " --matched-precision {params.matched_precision} --replicas {params.replicas}"
        " --precisions {params.precisions} --constructions {params.constructions}"
        " --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule gather_transplants:
    input:
        transplant_tables(),
    output:
        ledger("tables", "transplants.parquet"),
    log:
        ledger("logs", "gather_transplants.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{STAGEREPLAY} gather --table transplants --out {output:q} {input:q} > {log:q} 2>&1"
        " || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule summary:
    input:
        trajectories=rules.gather.output,
        comparisons=rules.compare.output,
        transplants=rules.gather_transplants.output if TRANSPLANT["enabled"] else [],
    output:
        ledger("summary.json"),
    params:
        transplants=lambda wildcards, input: f"--transplants {input.transplants}" if TRANSPLANT["enabled"] else "",
    log:
        ledger("logs", "summary.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "{STAGEREPLAY} summarize --trajectories {input.trajectories:q} --comparisons {input.comparisons:q}"
        " {params.transplants} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
