# The two kinds of model job. `live` generates to the stage boundary and keeps
# its cache; `rebuild` rebuilds the boundary state of a saved live prefix by
# another construction. Both then continue greedily. Checkpoint, precision,
# construction, replica and shard are path components, so adding a precision
# or a construction schedules only the new jobs.


def live_table(checkpoint, precision, replica, shard):
    return ledger("runs", "live", checkpoint, precision, f"rep{replica}", f"shard-{shard}.parquet")


def rebuilt_table(checkpoint, prefix_precision, precision, construction, replica, shard):
    return ledger(
        "runs", "rebuild", checkpoint, f"{prefix_precision}-prefix", precision,
        construction_token(construction), f"rep{replica}", f"shard-{shard}.parquet",
    )


rule live:
    input:
        model=ledger("models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        prompts=ledger("prompts", "{checkpoint}.parquet"),
    output:
        ledger("runs", "live", "{checkpoint}", "{precision}", "rep{replica}", "shard-{shard}.parquet"),
    params:
        runtime=runtime_args,
        max_new_tokens=STAGE["max_new_tokens"],
        marker=f"--marker {shlex.quote(STAGE['marker'])}" if STAGE["marker"] else "",
        store=ledger("objects"),
    log:
        ledger("logs", "live", "{checkpoint}", "{precision}", "rep{replica}", "shard-{shard}.log"),
    benchmark:
        ledger("benchmarks", "live", "{checkpoint}", "{precision}", "rep{replica}", "shard-{shard}.tsv")
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
        source=ledger("runs", "live", "{checkpoint}", "{prefix_precision}", "rep0", "shard-{shard}.parquet"),
    output:
        ledger(
            "runs", "rebuild", "{checkpoint}", "{prefix_precision}-prefix", "{precision}", "{construction}",
            "rep{replica}", "shard-{shard}.parquet",
        ),
    params:
        runtime=runtime_args,
        construction=lambda wildcards: wildcards.construction.replace("-", ":"),
        store=ledger("objects"),
        source_store=ledger("objects"),
    log:
        ledger(
            "logs", "rebuild", "{checkpoint}", "{prefix_precision}-prefix", "{precision}", "{construction}",
            "rep{replica}", "shard-{shard}.log",
        ),
    benchmark:
        ledger(
            "benchmarks", "rebuild", "{checkpoint}", "{prefix_precision}-prefix", "{precision}", "{construction}",
            "rep{replica}", "shard-{shard}.tsv",
        )
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    shell:
        "{STAGEREPLAY} rebuild --model-record {input.model:q} --items {input.item_file:q} --source-shard {input.source:q}"
        " --construction {params.construction} {params.runtime} --store {params.store:q}"
        " --source-store {params.source_store:q} --out {output:q}"
        " 2> {log:q} || {{ tail -n 1 {log:q} >&2; exit 1; }}"
