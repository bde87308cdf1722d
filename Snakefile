# stagereplay: does continuing from the live KV cache differ from continuing
# after a one-shot prefill of the very same tokens?  See README.md.

from snakemake.utils import min_version

min_version("9.0")

# No configfile of its own: the default run is the schema's defaults (workflow/schemas/config.schema.yaml),
# and a --configfile states only what differs, so it means the same from any working directory.


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/items.smk"
include: "workflow/rules/matched.smk"
include: "workflow/rules/fixed_prefix.smk"
include: "workflow/rules/transplant.smk"
include: "workflow/rules/factors.smk"
include: "workflow/rules/served.smk"
include: "workflow/rules/ledger.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/audit.smk"


# What a plain `snakemake` makes: the ledger, its summary and the card.
RUN_TARGETS = [
    LAYOUT.provenance,
    LAYOUT.stored,
    LAYOUT.summary,
    # named here too: adding factors to a finished ledger must schedule E6 even where snakemake has no
    # record of summary.json's inputs (a copied ledger), and its new table then reruns the summary
    LAYOUT.table("factors") if FACTOR_LEVELS else [],
    LAYOUT.table("served") if SERVED_SERVERS else [],
    rules.report.output,
]


# Under `--config mode=audit` the default target is the audit (rule audit), so no target need be named.
rule all:
    input:
        rules.audit.input if AUDITING else RUN_TARGETS,
