# Gather every shard table into the ledger's Parquet tables, compare the pairs
# each experiment defines (E1, E2, E3), then write the figures.


localrules:
    gather,
    gather_transplants,
    compare,
    summary,


rule gather:
    input:
        all_shard_tables(),
    output:
        LAYOUT.table("trajectories"),
    log:
        LAYOUT.log("gather.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "stagereplay gather --out {output:q} {input:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule compare:
    input:
        LAYOUT.table("trajectories"),
    output:
        LAYOUT.table("comparisons"),
    log:
        LAYOUT.log("compare.log"),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        store=LAYOUT.objects,
        primary=PRIMARY,
        replications=" ".join(REPLICATIONS),
        matched_precision=E1,
        replicas=MATCHED["replicas"],
        precisions=" ".join(FIXED["precisions"]),
        constructions=" ".join(shlex.quote(name) for name in CONSTRUCTIONS),
    shell:
        "stagereplay compare --trajectories {input:q} --store {params.store:q}"
        " --primary {params.primary} --replications {params.replications}"
        " --matched-precision {params.matched_precision} --replicas {params.replicas}"
        " --precisions {params.precisions} --constructions {params.constructions}"
        " --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule gather_transplants:
    input:
        transplant_tables(),
    output:
        LAYOUT.table("transplants"),
    log:
        LAYOUT.log("gather_transplants.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "stagereplay gather --table transplants --out {output:q} {input:q} > {log:q} 2>&1"
        " || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule summary:
    input:
        trajectories=LAYOUT.table("trajectories"),
        comparisons=LAYOUT.table("comparisons"),
        transplants=LAYOUT.table("transplants") if TRANSPLANT["enabled"] else [],
    output:
        LAYOUT.summary,
    log:
        LAYOUT.log("summary.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        transplants=lambda wildcards, input: f"--transplants {input.transplants}" if TRANSPLANT["enabled"] else "",
    shell:
        "stagereplay summarize --trajectories {input.trajectories:q} --comparisons {input.comparisons:q}"
        " {params.transplants} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
