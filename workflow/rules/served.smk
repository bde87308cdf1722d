# Served requests: per item of the primary checkpoint's prompts, whole greedy requests to each server of the
# served block (deployed by this job with an operator's flags, or attached at a URL): alone twice, amid other
# clients, as a prompt-cache hit (experiments/served.py). One job per server; a new server schedules only its own.


localrules:
    gather_served,


rule served:
    input:
        model=LAYOUT.model_record(PRIMARY),
        prompts=LAYOUT.prompts(PRIMARY),
        vocab=LAYOUT.vocab(PRIMARY),
        item_file=LAYOUT.items,
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.served_table("{server}"),
    log:
        LAYOUT.job_log(LAYOUT.served_table("{server}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.served_table("{server}"))
    # A deployed server takes every core it is given and its timing is the measurement: nothing runs beside it.
    threads: lambda wildcards: 1 if "url" in SERVED["servers"][wildcards.server] else workflow.cores
    resources:
        **MODEL_RESOURCES,
    params:
        entry=lambda wildcards: shlex.quote(json.dumps(SERVED["servers"][wildcards.server] or {})),
        design=SERVED_DESIGN_ARGS,
        recorded="",  # the audit's: the saved table whose server record the server must match
    shell:
        tail_log_on_failure(
            "stagereplay served --model-record {input.model:q} --prompts {input.prompts:q} --vocab {input.vocab:q}"
            " --items {input.item_file:q}"
            " --server {wildcards.server}"
            " --server-spec {params.entry} {params.design} {params.recorded} --out {output:q} 2> {log:q}"
        )


rule gather_served:
    input:
        [LAYOUT.served_table(name) for name in SERVED_SERVERS],
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.table("served"),
    log:
        LAYOUT.log("gather_served"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        tail_log_on_failure("stagereplay gather --table served --out {output:q} {input:q} > {log:q} 2>&1")
