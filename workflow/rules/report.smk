# The findings report: the results card (results.md, and as HTML for `snakemake --report`)
# and the plots, drawn from the ledger. Light and local. A plain run does not depend on the
# audit (it never runs it): it shows E4 when audit/e4.json describes the current tables
# (e4_option, e4_version in common.smk), else "not run". `snakemake --config mode=audit` ends by redrawing
# the card with the E4 it has just written.

from stagereplay.report.plots import PLOT_FILES


localrules:
    report,


rule report:
    input:
        summary=LAYOUT.summary,
        trajectories=LAYOUT.table("trajectories"),
        comparisons=LAYOUT.table("comparisons"),
        transplants=LAYOUT.table("transplants") if TRANSPLANT["enabled"] else [],
        factors=LAYOUT.table("factors") if FACTOR_LEVELS else [],
        # Read only to tell whether the audit's e4.json was made against these very tables.
        served=LAYOUT.table("served") if SERVED_SERVERS else [],
        models=[LAYOUT.model_record(name) for name in USED_CHECKPOINTS],
        vocab=[LAYOUT.vocab(name) for name in USED_CHECKPOINTS],
        item_file=LAYOUT.items,
        # Under `--config mode=audit` the card is redrawn after the audit, with E4.
        e4=LAYOUT.e4 if AUDITING else [],
    output:
        **{
            name: report(LAYOUT.plot(file), caption=f"../report/{name}.rst", category="2. Plots")
            for name, file in PLOT_FILES.items()
        },
        card=LAYOUT.card,
        card_html=report(LAYOUT.card_html, caption="../report/results_card.rst", category="1. Results card"),
    log:
        LAYOUT.log("report"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        transplants=lambda wildcards, input: f"--transplants {input.transplants}" if TRANSPLANT["enabled"] else "",
        factors=lambda wildcards, input: f"--factors {input.factors}" if FACTOR_LEVELS else "",
        served=lambda wildcards, input: f"--served {input.served}" if SERVED_SERVERS else "",
        models=lambda wildcards, input: " ".join(
            f"--model {name} {shlex.quote(path)}" for name, path in zip(USED_CHECKPOINTS, input.models)
        ),
        vocab=lambda wildcards, input: " ".join(
            f"--vocab {name} {shlex.quote(path)}" for name, path in zip(USED_CHECKPOINTS, input.vocab)
        ),
        e4=lambda wildcards, input: f"--e4 {shlex.quote(input.e4)}" if input.e4 else e4_option(wildcards),
        e4_version=e4_version,
        item_source=ITEMS_SPEC["source"],
        plots_dir=lambda wildcards, output: str(Path(output.card_html).parent),
    shell:
        tail_log_on_failure(
            "stagereplay report --summary {input.summary:q} --trajectories {input.trajectories:q}"
            " --comparisons {input.comparisons:q} {params.transplants} {params.factors} {params.served} {params.models} {params.vocab} {params.e4} --items {input.item_file:q}"
            " --item-source {params.item_source:q} --card {output.card:q} --card-html {output.card_html:q}"
            " --plots-dir {params.plots_dir:q} > {log:q} 2>&1"
        )
