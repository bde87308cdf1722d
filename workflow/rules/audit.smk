# E4 (audit): `snakemake --cores N audit` recomputes every saved shard from its saved
# inputs into <ledger>/audit/ — never over the saved ledger — and compares every
# fingerprint. The audit jobs are the run's own rules with other outputs: live from
# the saved prompt tokens, rebuild from the saved live prefixes, transplant from the
# saved caches and selection; each reads the saved store and writes the audit store.
# The saved ledger is verified first, so a corrupt ledger stops the audit at once: what the
# audit reads (--audit-inputs), since summary.json and the card may be redrawn later in the same run.

AUDIT_RUNTIME = {**RUNTIME, **{key: value for key, value in config["audit"]["runtime"].items() if value is not None}}
AUDIT_STORE = ledger("audit", "objects")


def audited(path):
    """The audit tree's twin of a saved ledger path."""
    return ledger("audit", Path(path).relative_to(LEDGER))


def audit_runtime_args(wildcards, replica=None):
    return runtime_args(wildcards, replica, AUDIT_RUNTIME)


AUDIT_MODEL_RESOURCES = {**MODEL_RESOURCES, "gpu": 1 if AUDIT_RUNTIME["device"] == "cuda" else 0}


localrules:
    audit_verify,
    audit_gather,
    audit_compare,
    audit_gather_transplants,
    audit_select_transplants,
    audit_ledger,
    audit,


rule audit_verify:
    input:
        rules.gather.output,
        rules.compare.output,
        rules.gather_transplants.output if TRANSPLANT["enabled"] else [],
    output:
        ledger("audit", "verified.txt"),
    log:
        ledger("logs", "audit", "verify.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    shell:
        "{STAGEREPLAY} verify {LEDGER:q} --audit-inputs --out {output:q} > {log:q} 2>&1"
        " || {{ grep -m 3 'fault:' {log:q} >&2; tail -n 1 {log:q} >&2; exit 1; }}"


use rule register_model as audit_register_model with:
    input:
        registered_folder_input,
        ledger("audit", "verified.txt"),
    output:
        ledger("audit", "models", "{checkpoint}", "model.json"),
    log:
        ledger("logs", "audit", "register_model", "{checkpoint}.log"),


use rule live as audit_live with:
    input:
        model=ledger("audit", "models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        prompts=ledger("prompts", "{checkpoint}.parquet"),
    output:
        ledger("audit", "runs", "live", "{checkpoint}", "{precision}", "rep{replica}", "shard-{shard}.parquet"),
    params:
        runtime=audit_runtime_args,
        store=AUDIT_STORE,
    log:
        ledger("logs", "audit", "live", "{checkpoint}", "{precision}", "rep{replica}", "shard-{shard}.log"),
    benchmark:
        ledger("benchmarks", "audit", "live", "{checkpoint}", "{precision}", "rep{replica}", "shard-{shard}.tsv")
    threads: AUDIT_RUNTIME["threads"]
    resources:
        **AUDIT_MODEL_RESOURCES,


use rule rebuild as audit_rebuild with:
    input:
        model=ledger("audit", "models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        source=ledger("runs", "live", "{checkpoint}", "{prefix_precision}", "rep0", "shard-{shard}.parquet"),
    output:
        ledger(
            "audit", "runs", "rebuild", "{checkpoint}", "{prefix_precision}-prefix", "{precision}", "{construction}",
            "rep{replica}", "shard-{shard}.parquet",
        ),
    params:
        runtime=audit_runtime_args,
        store=AUDIT_STORE,
    log:
        ledger(
            "logs", "audit", "rebuild", "{checkpoint}", "{prefix_precision}-prefix", "{precision}", "{construction}",
            "rep{replica}", "shard-{shard}.log",
        ),
    benchmark:
        ledger(
            "benchmarks", "audit", "rebuild", "{checkpoint}", "{prefix_precision}-prefix", "{precision}",
            "{construction}", "rep{replica}", "shard-{shard}.tsv",
        )
    threads: AUDIT_RUNTIME["threads"]
    resources:
        **AUDIT_MODEL_RESOURCES,


use rule transplant as audit_transplant with:
    input:
        model=ledger("audit", "models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
        selection=ledger("transplants", "selection.json"),
        tables=lambda wildcards: sorted({path for pair in transplant_pairs(wildcards) for path in pair}),
    output:
        ledger("audit", "runs", "transplant", "{selection}", "{checkpoint}", "{precision}", "shard-{shard}.parquet"),
    params:
        runtime=lambda wildcards: audit_runtime_args(wildcards, replica=0),
        store=AUDIT_STORE,
    log:
        ledger("logs", "audit", "transplant", "{selection}", "{checkpoint}", "{precision}", "shard-{shard}.log"),
    benchmark:
        ledger("benchmarks", "audit", "transplant", "{selection}", "{checkpoint}", "{precision}", "shard-{shard}.tsv")
    threads: AUDIT_RUNTIME["threads"]
    resources:
        **AUDIT_MODEL_RESOURCES,


use rule gather as audit_gather with:
    input:
        [audited(table) for table in all_shard_tables()],
    output:
        ledger("audit", "tables", "trajectories.parquet"),
    log:
        ledger("logs", "audit", "gather.log"),


use rule compare as audit_compare with:
    input:
        ledger("audit", "tables", "trajectories.parquet"),
    output:
        ledger("audit", "tables", "comparisons.parquet"),
    params:
        store=AUDIT_STORE,
    log:
        ledger("logs", "audit", "compare.log"),


use rule gather_transplants as audit_gather_transplants with:
    input:
        [audited(table) for table in transplant_tables()],
    output:
        ledger("audit", "tables", "transplants.parquet"),
    log:
        ledger("logs", "audit", "gather_transplants.log"),


use rule select_transplants as audit_select_transplants with:
    input:
        live=[audited(live_table(PRIMARY, MATCHED["precision"], 0, shard)) for shard in SHARDS],
        prefill=[
            audited(rebuilt_table(PRIMARY, MATCHED["precision"], MATCHED["precision"], "prefill", 0, shard))
            for shard in SHARDS
        ],
    output:
        ledger("audit", "transplants", "selection.json"),
    log:
        ledger("logs", "audit", "select_transplants.log"),


def audit_inputs():
    saved = [ledger("tables", "trajectories.parquet"), ledger("tables", "comparisons.parquet")]
    saved += [ledger("models", name, "model.json") for name in sorted({PRIMARY, BLIND_CHECKPOINT})]
    if TRANSPLANT["enabled"]:
        saved += [ledger("tables", "transplants.parquet"), ledger("transplants", "selection.json")]
    return saved + [audited(path) for path in saved]


rule audit_ledger:
    input:
        audit_inputs(),
        summary=ledger("summary.json"),
    output:
        ledger("tables", "audit.parquet"),
    params:
        audit_dir=ledger("audit"),
        runtime=shlex.quote(json.dumps({key: AUDIT_RUNTIME[key] for key in ("device", "threads", "attn_implementation")})),
    log:
        ledger("logs", "audit", "audit.log"),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "{STAGEREPLAY} audit --ledger {LEDGER:q} --audit-dir {params.audit_dir:q} --summary {input.summary:q}"
        " --audit-runtime {params.runtime} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }};"
        " tail -n 1 {log:q}"


rule audit:
    input:
        rules.audit_ledger.output,
