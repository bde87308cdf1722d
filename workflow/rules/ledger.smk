# Gather every shard table into the ledger's Parquet tables, compare the pairs
# each experiment defines, then write the figures.


localrules:
    gather,
    compare,
    summary,


def all_shard_tables():
    return sorted(set(matched_tables() + fixed_prefix_tables() + bridge_tables()))


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
        " --matched-precision {params.matched_precision} --replicas {params.replicas}"
        " --precisions {params.precisions} --constructions {params.constructions}"
        " --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule summary:
    input:
        trajectories=rules.gather.output,
        comparisons=rules.compare.output,
    output:
        ledger("summary.json"),
    log:
        ledger("logs", "summary.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "{STAGEREPLAY} summarize --trajectories {input.trajectories:q} --comparisons {input.comparisons:q}"
        " --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
