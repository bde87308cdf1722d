# Gather every shard table into the ledger's Parquet tables, compare the pairs
# each experiment defines (E1, E2, E3), then write the figures.


localrules:
    provenance,
    store_caches_policy,
    gather,
    gather_transplants,
    summary,


# compare is a light local job when every cache is stored; otherwise it rebuilds caches on the model.
# storage is light and local when it only deletes (store_caches: none).
if not COMPARE_REBUILDS:

    localrules:
        compare,


if STORE_CACHES == "none":

    localrules:
        storage,


# Written last, from the finished run: a run that fails on the way leaves the record of the ledger as it was.
rule provenance:
    input:
        item_file=LAYOUT.items,
        models=[LAYOUT.model_record(name) for name in USED_CHECKPOINTS],
        summary=LAYOUT.summary,
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.provenance,
    log:
        LAYOUT.log("provenance"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        # The resolved design is a parameter: changing any key records the run again (a light job).
        design=shlex.quote(json.dumps(DESIGN)),  # in order: the first checkpoint is the primary one
        models=lambda wildcards, input: " ".join(
            f"--model {name} {shlex.quote(path)}" for name, path in zip(USED_CHECKPOINTS, input.models)
        ),
    shell:
        tail_log_on_failure(
            "stagereplay provenance --design {params.design} --items {input.item_file:q} {params.models}"
            " --out {output:q} > {log:q} 2>&1"
        )


rule store_caches_policy:
    input:
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.storage,
    log:
        LAYOUT.log("store_caches_policy"),
    priority: 100  # first: the model jobs read it when they store (the storage rule settles the store anyway)
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    params:
        policy=STORE_CACHES,
    shell:
        tail_log_on_failure("stagereplay store-caches-policy --policy {params.policy} --out {output:q} > {log:q} 2>&1")


# The store holds what store_caches keeps, after every job that writes or reads caches: a changed
# policy reruns only this (and store_caches_policy), which deletes or materialises tensors, then verifies.
rule storage:
    input:
        audit_guard=AUDIT_GUARD,
        policy=LAYOUT.storage,
        # verify, at its end, needs the record a finished ledger has (on a cluster it could run before it)
        provenance=LAYOUT.provenance,
        trajectories=LAYOUT.table("trajectories"),
        comparisons=LAYOUT.table("comparisons"),
        transplants=LAYOUT.table("transplants") if TRANSPLANT["enabled"] else [],
        factors=LAYOUT.table("factors") if FACTOR_LEVELS else [],
        models=[LAYOUT.model_record(name) for name in COMPARED_CHECKPOINTS],
    output:
        LAYOUT.stored,
    log:
        LAYOUT.log("storage"),
    threads: RUNTIME["threads"]
    resources:
        **(MODEL_RESOURCES if STORE_CACHES != "none" else dict(mem_mb=2000, runtime=30)),
    params:
        policy=STORE_CACHES,
        ledger=lambda wildcards: LAYOUT.directory,
        rebuild=rebuild_args(LAYOUT, RUNTIME),
    shell:
        tail_log_on_failure(
            "stagereplay apply-storage --ledger {params.ledger:q} --policy {params.policy} {params.rebuild}"
            " --out {output:q} > {log:q} 2>&1",
            show_last_line=True,
        )


rule gather:
    input:
        all_shard_tables(),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.table("trajectories"),
    log:
        LAYOUT.log("gather"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        tail_log_on_failure("stagereplay gather --out {output:q} {input:q} > {log:q} 2>&1")


rule compare:
    input:
        trajectories=LAYOUT.table("trajectories"),
        models=[LAYOUT.model_record(name) for name in COMPARED_CHECKPOINTS],
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.table("comparisons"),
    log:
        LAYOUT.log("compare"),
    threads: RUNTIME["threads"] if COMPARE_REBUILDS else 1
    resources:
        **(MODEL_RESOURCES if COMPARE_REBUILDS else dict(mem_mb=4000, runtime=30)),
    params:
        store=LAYOUT.objects,
        source_stores="",
        rebuild=rebuild_args(LAYOUT, RUNTIME),
        primary=PRIMARY,
        replications=" ".join(REPLICATIONS),
        matched_precision=E1,
        replicas=MATCHED["replicas"],
        precisions=" ".join(FIXED["precisions"]),
        constructions=" ".join(shlex.quote(name) for name in CONSTRUCTIONS),
    shell:
        tail_log_on_failure(
            "stagereplay compare --trajectories {input.trajectories:q} --store {params.store:q} {params.source_stores}"
            " {params.rebuild}"
            " --primary {params.primary} --replications {params.replications}"
            " --matched-precision {params.matched_precision} --replicas {params.replicas}"
            " --precisions {params.precisions} --constructions {params.constructions}"
            " --out {output:q} > {log:q} 2>&1"
        )


rule gather_transplants:
    input:
        transplant_tables(),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.table("transplants"),
    log:
        LAYOUT.log("gather_transplants"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        tail_log_on_failure("stagereplay gather --table transplants --out {output:q} {input:q} > {log:q} 2>&1")


rule summary:
    input:
        trajectories=LAYOUT.table("trajectories"),
        comparisons=LAYOUT.table("comparisons"),
        transplants=LAYOUT.table("transplants") if TRANSPLANT["enabled"] else [],
        factors=LAYOUT.table("factors") if FACTOR_LEVELS else [],
        served=LAYOUT.table("served") if SERVED_SERVERS else [],
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.summary,
    log:
        LAYOUT.log("summary"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        transplants=lambda wildcards, input: f"--transplants {input.transplants}" if TRANSPLANT["enabled"] else "",
        factors=lambda wildcards, input: f"--factors {input.factors}" if FACTOR_LEVELS else "",
        served=lambda wildcards, input: f"--served {input.served}" if SERVED_SERVERS else "",
    shell:
        tail_log_on_failure(
            "stagereplay summarize --trajectories {input.trajectories:q} --comparisons {input.comparisons:q}"
            " {params.transplants} {params.factors} {params.served} --out {output:q} > {log:q} 2>&1"
        )
