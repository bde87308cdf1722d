# E1 (matched): the live side generates to the stage boundary; every other
# construction rebuilds the boundary state from the live side's saved prefix.


def shard_table(experiment, checkpoint, precision, construction, replica, shard):
    return ledger("runs", experiment, checkpoint, precision, construction, f"rep{replica}", f"shard-{shard}.parquet")


rule live:
    input:
        model=ledger("models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        prompts=ledger("prompts", "{checkpoint}.parquet"),
    output:
        ledger("runs", "matched", "{checkpoint}", "{precision}", "live", "rep{replica}", "shard-{shard}.parquet"),
    params:
        runtime=runtime_args,
        max_new_tokens=STAGE["max_new_tokens"],
        marker=f"--marker {shlex.quote(STAGE['marker'])}" if STAGE["marker"] else "",
        store=ledger("objects"),
    log:
        ledger("logs", "matched", "{checkpoint}", "{precision}", "live", "rep{replica}", "shard-{shard}.log"),
    benchmark:
        ledger("benchmarks", "matched", "{checkpoint}", "{precision}", "live", "rep{replica}", "shard-{shard}.tsv")
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    shell:
        "{STAGEREPLAY} live --model-record {input.model:q} --items {input.item_file:q} --prompts {input.prompts:q}"
        " {params.runtime} --max-new-tokens {params.max_new_tokens} {params.marker}"
        " --store {params.store:q} --out {output:q} 2> {log:q} || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule rebuild:
    input:
        model=ledger("models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        source=ledger("runs", "matched", "{checkpoint}", "{precision}", "live", "rep0", "shard-{shard}.parquet"),
    output:
        ledger("runs", "matched", "{checkpoint}", "{precision}", "{construction}", "rep{replica}", "shard-{shard}.parquet"),
    wildcard_constraints:
        construction="prefill",
    params:
        runtime=runtime_args,
        store=ledger("objects"),
    log:
        ledger("logs", "matched", "{checkpoint}", "{precision}", "{construction}", "rep{replica}", "shard-{shard}.log"),
    benchmark:
        ledger("benchmarks", "matched", "{checkpoint}", "{precision}", "{construction}", "rep{replica}", "shard-{shard}.tsv")
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    shell:
        "{STAGEREPLAY} rebuild --model-record {input.model:q} --items {input.item_file:q} --source-shard {input.source:q}"
        " --construction {wildcards.construction} {params.runtime} --store {params.store:q} --out {output:q} 2> {log:q} || {{ tail -n 1 {log:q} >&2; exit 1; }}"


def matched_shards(wildcards=None):
    return [
        shard_table("matched", PRIMARY, MATCHED["precision"], construction, replica, shard)
        for construction in ("live", "prefill")
        for replica in range(MATCHED["replicas"])
        for shard in SHARDS
    ]
