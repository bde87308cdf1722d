# Items are validated at parse time (common.smk); here they are normalised and tokenized once.


localrules:
    items,


rule items:
    input:
        repo_path(config["items"]["source"]),
    output:
        ledger("items.jsonl"),
    params:
        format=config["items"]["format"],
        shuffle_seed=config["items"]["shuffle_seed"],
        limit=f"--limit {config['items']['limit']}" if config["items"]["limit"] else "",
    log:
        ledger("logs", "items.log"),
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    shell:
        "{STAGEREPLAY} items --source {input:q} --format {params.format} --shuffle-seed {params.shuffle_seed}"
        " {params.limit} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule prompts:
    input:
        model=ledger("models", "{checkpoint}", "model.json"),
        item_file=ledger("items.jsonl"),
    output:
        ledger("prompts", "{checkpoint}.parquet"),
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
    log:
        ledger("logs", "prompts", "{checkpoint}.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{STAGEREPLAY} prompts --model-record {input.model:q} --items {input.item_file:q}"
        " --max-new-tokens {params.max_new_tokens} --suffix-tokens {params.suffix_tokens} {params.flags}"
        " --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
