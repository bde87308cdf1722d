# E4 (audit): `snakemake --cores N --config mode=audit` recomputes every saved shard from its saved
# inputs into <ledger>/audit/ — never over the saved ledger — and compares every
# fingerprint. The audit jobs are the run's own rules with other outputs: live from
# the saved prompt tokens, rebuild from the saved live prefixes, transplant from the
# saved caches and selection, factor from the saved prefill rows; each reads the saved store and writes the audit store:
# tokens and fingerprints, but no cache tensors unless audit.keep_caches (AUDIT_STORE_CACHES).
# The saved ledger is verified first, so a corrupt ledger stops the audit at once: what the
# audit reads (--audit-inputs), since summary.json and the card may be redrawn later in the same run.
# The result is its own: tables/audit.parquet and audit/e4.json (the report reads e4.json).


localrules:
    audit_verify,
    audit_gather,
    audit_gather_transplants,
    audit_gather_factors,
    audit_gather_served,
    audit_select_transplants,
    audit_ledger,
    audit,


# The audit's comparisons rebuild the caches it did not keep (audit.keep_caches), on the model.
if not AUDIT_COMPARE_REBUILDS:

    localrules:
        audit_compare,


rule audit_verify:
    input:
        AUDIT_NEEDS_MODE,
        LAYOUT.table("trajectories"),
        LAYOUT.table("comparisons"),
        LAYOUT.table("transplants") if TRANSPLANT["enabled"] else [],
        LAYOUT.table("factors") if FACTOR_LEVELS else [],
        LAYOUT.table("served") if SERVED_SERVERS else [],
    output:
        LAYOUT.audit_verified,
    log:
        LAYOUT.audit_log("verify"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    params:
        ledger=lambda wildcards: LAYOUT.directory,  # the whole saved ledger is checked, not one file
    shell:
        "stagereplay verify {params.ledger:q} --audit-inputs --out {output:q} > {log:q} 2>&1"
        " || {{ grep -m 3 'fault:' {log:q} >&2; tail -n 1 {log:q} >&2; exit 1; }}"


use rule register_model as audit_register_model with:
    input:
        lambda wildcards: RUN.registered_inputs(wildcards.checkpoint),
        LAYOUT.audit_verified,
    output:
        LAYOUT.audit.model_record("{checkpoint}"),
    log:
        LAYOUT.audit_log("register_model", "{checkpoint}"),
    params:
        # An attached checkpoint's server must be the one the ledger records (its build, model and slots).
        attach=lambda wildcards: RUN.attach_option(wildcards.checkpoint, str(LAYOUT.model_record(wildcards.checkpoint))),


use rule live as audit_live with:
    input:
        model=LAYOUT.audit.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        prompts=LAYOUT.prompts("{checkpoint}"),
    output:
        LAYOUT.audit.live_table("{checkpoint}", "{precision}", "{replica}", "{shard}"),
    log:
        LAYOUT.job_log(LAYOUT.audit.live_table("{checkpoint}", "{precision}", "{replica}", "{shard}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.audit.live_table("{checkpoint}", "{precision}", "{replica}", "{shard}"))
    threads: AUDIT_RUNTIME["threads"]
    resources:
        **AUDIT_MODEL_RESOURCES,
    params:
        runtime=audit_runtime_args,
        store=LAYOUT.audit.objects,


use rule rebuild as audit_rebuild with:
    input:
        model=LAYOUT.audit.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        prompts=LAYOUT.prompts("{checkpoint}"),
        source=LAYOUT.live_table("{checkpoint}", "{prefix_precision}", 0, "{shard}"),
    output:
        LAYOUT.audit.rebuilt_table(
            "{checkpoint}", "{prefix_precision}", "{precision}", "{construction}", "{replica}", "{shard}"
        ),
    log:
        LAYOUT.job_log(
            LAYOUT.audit.rebuilt_table(
                "{checkpoint}", "{prefix_precision}", "{precision}", "{construction}", "{replica}", "{shard}"
            )
        ),
    benchmark:
        LAYOUT.job_benchmark(
            LAYOUT.audit.rebuilt_table(
                "{checkpoint}", "{prefix_precision}", "{precision}", "{construction}", "{replica}", "{shard}"
            )
        )
    threads: AUDIT_RUNTIME["threads"]
    resources:
        **AUDIT_MODEL_RESOURCES,
    params:
        runtime=audit_runtime_args,
        store=LAYOUT.audit.objects,


use rule transplant as audit_transplant with:
    input:
        model=LAYOUT.audit.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        selection=LAYOUT.selection,
        tables=transplant_inputs,
    output:
        LAYOUT.audit.transplant_table("{selection}", "{checkpoint}", "{precision}", "{shard}"),
    log:
        LAYOUT.job_log(LAYOUT.audit.transplant_table("{selection}", "{checkpoint}", "{precision}", "{shard}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.audit.transplant_table("{selection}", "{checkpoint}", "{precision}", "{shard}"))
    threads: AUDIT_RUNTIME["threads"]
    resources:
        **AUDIT_MODEL_RESOURCES,
    params:
        runtime=lambda wildcards: audit_runtime_args(wildcards, replica=0),
        store=LAYOUT.audit.objects,


use rule factor as audit_factor with:
    input:
        model=LAYOUT.audit.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        references=factor_references(),
    output:
        LAYOUT.audit.factor_table("{checkpoint}", "{precision}", "{factor}", "{level}", "{shard}"),
    log:
        LAYOUT.job_log(LAYOUT.audit.factor_table("{checkpoint}", "{precision}", "{factor}", "{level}", "{shard}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.audit.factor_table("{checkpoint}", "{precision}", "{factor}", "{level}", "{shard}"))
    threads: factor_threads
    resources:
        **AUDIT_MODEL_RESOURCES,
    params:
        runtime=lambda wildcards: audit_runtime_args(wildcards, replica=0),
        store=LAYOUT.audit.objects,
        source_store=LAYOUT.objects,
        load_runs=LOAD_RUNS,


use rule gather as audit_gather with:
    input:
        [LAYOUT.audited(table) for table in all_shard_tables()],
    output:
        LAYOUT.audit.table("trajectories"),
    log:
        LAYOUT.audit_log("gather"),


use rule compare as audit_compare with:
    input:
        trajectories=LAYOUT.audit.table("trajectories"),
        models=([LAYOUT.audit.model_record(name) for name in COMPARED_CHECKPOINTS] if AUDIT_COMPARE_REBUILDS else []),
    output:
        LAYOUT.audit.table("comparisons"),
    log:
        LAYOUT.audit_log("compare"),
    threads: AUDIT_RUNTIME["threads"] if AUDIT_COMPARE_REBUILDS else 1
    resources:
        **(AUDIT_MODEL_RESOURCES if AUDIT_COMPARE_REBUILDS else dict(mem_mb=4000, runtime=30)),
    params:
        store=LAYOUT.audit.objects,
        # A recomputed cache equal to the saved one is the saved object (content-addressed): read it there.
        source_stores=f"--source-store {shlex.quote(LAYOUT.objects)}",
        rebuild=rebuild_args(LAYOUT.audit, AUDIT_RUNTIME) if AUDIT_COMPARE_REBUILDS else "",


use rule gather_transplants as audit_gather_transplants with:
    input:
        [LAYOUT.audited(table) for table in transplant_tables()],
    output:
        LAYOUT.audit.table("transplants"),
    log:
        LAYOUT.audit_log("gather_transplants"),


use rule gather_factors as audit_gather_factors with:
    input:
        factor_tables(LAYOUT.audit),
    output:
        LAYOUT.audit.table("factors"),
    log:
        LAYOUT.audit_log("gather_factors"),


use rule select_transplants as audit_select_transplants with:
    input:
        **selection_inputs(LAYOUT.audit),
    output:
        LAYOUT.audit.selection,
    log:
        LAYOUT.audit_log("select_transplants"),


rule audit_ledger:
    input:
        RUN.audit_inputs,
    output:
        table=LAYOUT.table("audit"),
        e4=LAYOUT.e4,
    log:
        LAYOUT.audit_log("audit"),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        ledger=lambda wildcards: LAYOUT.directory,  # the saved ledger and its audit tree, read as a whole
        checkpoints=" ".join(AUDITED_CHECKPOINTS),
    shell:
        tail_log_on_failure(
            "stagereplay audit --ledger {params.ledger:q} --checkpoints {params.checkpoints}"
            " --out {output.table:q} --e4 {output.e4:q}"
            " > {log:q} 2>&1",
            show_last_line=True,
        )


rule audit:
    input:
        rules.audit_ledger.output,
        rules.report.output,


use rule served as audit_served with:
    input:
        model=LAYOUT.audit.model_record(PRIMARY),
        prompts=LAYOUT.prompts(PRIMARY),
        vocab=LAYOUT.vocab(PRIMARY),
        item_file=LAYOUT.items,
        # the saved record of this server: an attached server that says something else of itself is refused
        recorded=LAYOUT.served_table("{server}"),
    output:
        LAYOUT.audit.served_table("{server}"),
    log:
        LAYOUT.job_log(LAYOUT.audit.served_table("{server}")),
    benchmark:
        LAYOUT.job_benchmark(LAYOUT.audit.served_table("{server}"))
    params:
        entry=lambda wildcards: shlex.quote(json.dumps(SERVED["servers"][wildcards.server] or {})),
        design=SERVED_DESIGN_ARGS,
        recorded=lambda wildcards, input: f"--recorded {shlex.quote(input.recorded)}",


use rule gather_served as audit_gather_served with:
    input:
        [LAYOUT.audit.served_table(name) for name in SERVED_SERVERS],
    output:
        LAYOUT.audit.table("served"),
    log:
        LAYOUT.audit_log("gather_served"),
