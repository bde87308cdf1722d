# Gather every shard table into the ledger's Parquet tables, then the figures.


localrules:
    gather,
    summary,


rule gather:
    input:
        matched_shards(),
    output:
        trajectories=ledger("tables", "trajectories.parquet"),
        matched=ledger("tables", "matched.parquet"),
    params:
        out_dir=ledger("tables"),
    log:
        ledger("logs", "gather.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{STAGEREPLAY} gather --out-dir {params.out_dir:q} {input:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule summary:
    input:
        rules.gather.output,
    output:
        ledger("summary.json"),
    params:
        tables=ledger("tables"),
    log:
        ledger("logs", "summary.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "{STAGEREPLAY} summarize --tables {params.tables:q} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
