# E5 (transplant): swap boundary caches between live and prefill on divergent
# items, in both directions; sweep layer subsets, K/V and positions on the
# selected set; repeat all layers on an outcome-blind sample; and cast caches
# across precisions. Model jobs are shards, like every other model job.


localrules:
    select_transplants,  # reads the E1 shard tables and writes a small JSON: no cluster job


rule select_transplants:
    input:
        **selection_inputs(LAYOUT),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.selection,
    log:
        LAYOUT.log("select_transplants"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    params:
        first_k=f"--first-k {TRANSPLANT['selected']['first_k']}" if TRANSPLANT["selected"]["first_k"] else "",
        blind=lambda wildcards: " ".join(BLIND_IDS),
        blind_checkpoint=BLIND_CHECKPOINT,
        seed=BLIND["seed"],
    shell:
        tail_log_on_failure(
            "stagereplay select-transplants --live {input.live:q} --prefill {input.prefill:q} {params.first_k}"
            " --outcome-blind-checkpoint {params.blind_checkpoint} --outcome-blind-ids {params.blind} --seed {params.seed}"
            " --out {output:q} > {log:q} 2>&1"
        )


rule transplant:
    input:
        model=LAYOUT.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        selection=LAYOUT.selection,
        tables=transplant_inputs,
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.transplant_table("{selection}", "{checkpoint}", "{precision}", "{shard}"),
    log:
        LAYOUT.job_log(LAYOUT.transplant_table("{selection}", "{checkpoint}", "{precision}", "{shard}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.transplant_table("{selection}", "{checkpoint}", "{precision}", "{shard}"))
    threads: RUNTIME["threads"]
    resources:
        **MODEL_RESOURCES,
    params:
        runtime=lambda wildcards: runtime_args(wildcards, replica=0),
        pairs=transplant_pair_args,
        sweep=lambda wildcards: job_args.sweep_args(SWEEP) if wildcards.selection == "selected" else "",
        store=LAYOUT.objects,
        source_store=LAYOUT.objects,
    shell:
        tail_log_on_failure(
            "stagereplay transplant --model-record {input.model:q} --items {input.item_file:q}"
            " --selection {wildcards.selection} --selection-file {input.selection:q} {params.pairs} {params.sweep}"
            " {params.runtime} --store {params.store:q} --source-store {params.source_store:q}"
            " --out {output:q} 2> {log:q}"
        )
