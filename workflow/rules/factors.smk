# E6 (factors): hold the E1 prefix fixed and change one runtime setting a server changes. For each
# test level, an item's boundary cache is built under the level or the reference and continued under
# each (design/factors.py defines the cells and verdicts); the reference cell is E2's prefill row.
# Factor and level are path components: a new level schedules only its own jobs.


localrules:
    gather_factors,


rule factor:
    input:
        model=LAYOUT.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        # a batch's companions may lie in any shard, so every job reads every reference shard
        references=factor_references(),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.factor_table("{checkpoint}", "{precision}", "{factor}", "{level}", "{shard}"),
    log:
        LAYOUT.job_log(LAYOUT.factor_table("{checkpoint}", "{precision}", "{factor}", "{level}", "{shard}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.factor_table("{checkpoint}", "{precision}", "{factor}", "{level}", "{shard}"))
    threads: factor_threads
    resources:
        **MODEL_RESOURCES,
    params:
        runtime=lambda wildcards: runtime_args(wildcards, replica=0),
        store=LAYOUT.objects,
        source_store=LAYOUT.objects,
        load_runs=LOAD_RUNS,
    shell:
        tail_log_on_failure(
            "stagereplay factor --model-record {input.model:q} --items {input.item_file:q}"
            " --factor {wildcards.factor} --level {wildcards.level} --reference {input.references:q}"
            " --load-runs {params.load_runs} {params.runtime} --store {params.store:q}"
            " --source-store {params.source_store:q}"
            " --out {output:q} 2> {log:q}"
        )


rule gather_factors:
    input:
        factor_tables(),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.table("factors"),
    log:
        LAYOUT.log("gather_factors"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        tail_log_on_failure("stagereplay gather --table factors --out {output:q} {input:q} > {log:q} 2>&1")
