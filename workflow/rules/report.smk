# The findings report: the results card (results.md, and as HTML for `snakemake --report`)
# and the plots, drawn from the ledger. Light and local. It does not depend on the audit:
# the card shows E4 once the audit has written it into summary.json, and says "not run" before.

from stagereplay.plots import PLOT_FILES


localrules:
    report,


# The checkpoints the run uses (a configured but unused checkpoint is never registered).
REPORT_CHECKPOINTS = sorted({PRIMARY} | ({BLIND_CHECKPOINT} if TRANSPLANT["enabled"] else set()))


rule report:
    input:
        summary=ledger("summary.json"),
        trajectories=rules.gather.output,
        comparisons=rules.compare.output,
        transplants=rules.gather_transplants.output if TRANSPLANT["enabled"] else [],
        models=[ledger("models", name, "model.json") for name in REPORT_CHECKPOINTS],
        item_file=ledger("items.jsonl"),
    output:
        card=ledger("results.md"),
        card_html=report(ledger("report", "results.html"), caption="../report/results_card.rst", category="1. Results card"),
        **{
            name: report(ledger("report", file), caption=f"../report/{name}.rst", category="2. Plots")
            for name, file in PLOT_FILES.items()
        },
    params:
        transplants=lambda wildcards, input: f"--transplants {input.transplants}" if TRANSPLANT["enabled"] else "",
        item_source=config["items"]["source"],
        plots_dir=ledger("report"),
    log:
        ledger("logs", "report.log"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "{STAGEREPLAY} report --summary {input.summary:q} --trajectories {input.trajectories:q}"
        " --comparisons {input.comparisons:q} {params.transplants} --models {input.models:q} --items {input.item_file:q}"
        " --item-source {params.item_source:q} --card {output.card:q} --card-html {output.card_html:q}"
        " --plots-dir {params.plots_dir:q} > {log:q} 2>&1 || {{ tail -n 1 {log:q} >&2; exit 1; }}"
