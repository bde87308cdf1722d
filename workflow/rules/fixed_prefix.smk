# E2 (fixed_prefix): the saved live prefix is never regenerated. `rebuild` rebuilds its
# boundary state by another construction (prefill, incremental, chunked:N) at a precision
# (the fp32 arm upcasts the same checkpoint) and continues. The same job makes E1's
# prefill side and E3's incremental side. Construction and precision are path components.


rule rebuild:
    input:
        model=LAYOUT.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        prompts=LAYOUT.prompts("{checkpoint}"),
        source=LAYOUT.live_table("{checkpoint}", "{prefix_precision}", 0, "{shard}"),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.rebuilt_table(
            "{checkpoint}", "{prefix_precision}", "{precision}", "{construction}", "{replica}", "{shard}"
        ),
    log:
        LAYOUT.job_log(
            LAYOUT.rebuilt_table(
                "{checkpoint}", "{prefix_precision}", "{precision}", "{construction}", "{replica}", "{shard}"
            )
        ),
    benchmark:
        LAYOUT.job_benchmark(
            LAYOUT.rebuilt_table(
                "{checkpoint}", "{prefix_precision}", "{precision}", "{construction}", "{replica}", "{shard}"
            )
        )
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    params:
        runtime=runtime_args,
        construction=lambda wildcards: construction_of_token(wildcards.construction),
        store=LAYOUT.objects,
        source_store=LAYOUT.objects,
    shell:
        tail_log_on_failure(
            "stagereplay rebuild --model-record {input.model:q} --items {input.item_file:q} --source-shard {input.source:q}"
            " --prompts {input.prompts:q} --construction {params.construction} {params.runtime} --store {params.store:q}"
            " --source-store {params.source_store:q} --out {output:q}"
            " 2> {log:q}"
        )
