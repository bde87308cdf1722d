# Items are validated at parse time (common.smk); here they are normalised and tokenized once.


localrules:
    items,


rule items:
    input:
        RUN.repo_path(ITEMS_SPEC["source"]),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.items,
    log:
        LAYOUT.log("items"),
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    params:
        format=ITEMS_SPEC["format"],
        shuffle_seed=ITEMS_SPEC["shuffle_seed"],
        limit=f"--limit {ITEMS_SPEC['limit']}" if ITEMS_SPEC["limit"] else "",
    shell:
        tail_log_on_failure(
            "stagereplay items --source {input:q} --format {params.format} --shuffle-seed {params.shuffle_seed}"
            " {params.limit} --out {output:q} > {log:q} 2>&1"
        )


rule prompts:
    input:
        model=LAYOUT.model_record("{checkpoint}"),
        item_file=LAYOUT.items,
        audit_guard=AUDIT_GUARD,
    output:
        prompts=LAYOUT.prompts("{checkpoint}"),
        vocab=LAYOUT.vocab("{checkpoint}"),
    log:
        LAYOUT.log("prompts", "{checkpoint}"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        max_new_tokens=STAGE["max_new_tokens"],
        suffix_tokens=STAGE["suffix_tokens"],
        flags=" ".join(
            flag
            for flag, wanted in (
                ("--no-chat-template", not RUNTIME["use_chat_template"]),
                ("--trust-remote-code", RUNTIME["trust_remote_code"]),
            )
            if wanted
        ),
    shell:
        tail_log_on_failure(
            "stagereplay prompts --model-record {input.model:q} --items {input.item_file:q}"
            " --max-new-tokens {params.max_new_tokens} --suffix-tokens {params.suffix_tokens} {params.flags}"
            " --out {output.prompts:q} --vocab-out {output.vocab:q} > {log:q} 2>&1"
        )
