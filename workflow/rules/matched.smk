# E1 (matched): the live side. `live` generates greedily to the stage boundary, keeps its
# cache and continues; it is the only job that generates a prefix. Its replicas are the
# same job with another replica number, in their own process. E1's prefill side is a
# `rebuild` job (fixed_prefix.smk); E3 compares the live runs at each precision with
# `rebuild` by incremental (no jobs of its own: rule compare, ledger.smk). Checkpoint,
# precision, replica and shard are path components, so a new precision schedules only
# the new jobs.


rule live:
    input:
        model=LAYOUT.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        prompts=LAYOUT.prompts("{checkpoint}"),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.live_table("{checkpoint}", "{precision}", "{replica}", "{shard}"),
    log:
        LAYOUT.job_log(LAYOUT.live_table("{checkpoint}", "{precision}", "{replica}", "{shard}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.live_table("{checkpoint}", "{precision}", "{replica}", "{shard}"))
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    params:
        runtime=runtime_args,
        max_new_tokens=STAGE["max_new_tokens"],
        marker=f"--marker {shlex.quote(STAGE['marker'])}" if STAGE["marker"] else "",
        store=LAYOUT.objects,
    shell:
        tail_log_on_failure(
            "stagereplay live --model-record {input.model:q} --items {input.item_file:q} --prompts {input.prompts:q}"
            " {params.runtime} --max-new-tokens {params.max_new_tokens} {params.marker}"
            " --store {params.store:q} --out {output:q} 2> {log:q}"
        )
