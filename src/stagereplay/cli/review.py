"""A finished ledger read: verified, audited (E4), its card, one item."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stagereplay.cli.options import add_model_records


def cmd_verify(args) -> int:
    from stagereplay.audit.verify import verify_ledger

    report = verify_ledger(args.ledger_dir, documents=not args.audit_inputs)
    if args.inputs or args.config:
        from stagereplay.audit.provenance_check import given_inputs

        lines, faults = given_inputs(Path(args.ledger_dir), args.inputs, args.config)
        report.faults += faults
        for line in lines:
            print(line)
    if args.servers:
        lines, faults = attached_servers(Path(args.ledger_dir))
        report.faults += faults
        for line in lines:
            print(line)
    for note in report.notes:
        print(f"verify: note: {note}")
    for fault in report.faults:
        print(f"stagereplay: fault: {fault}", file=sys.stderr)
    print(report.summary_line(), file=sys.stderr if report.faults else sys.stdout)
    if report.faults:
        return 1
    if args.out:
        from stagereplay.ledger.atomic import atomic_write_text

        atomic_write_text(args.out, report.summary_line() + "\n")
    return 0


def attached_servers(ledger: Path) -> tuple[list[str], list[str]]:
    """``verify --servers``: each attached server the ledger records (a served server, from its served table and its
    URL and API-key variable from the ledger's own design; an attached checkpoint, from its model record), asked
    whether it is still the one recorded. Lines for those that are, faults."""
    import json

    from stagereplay.engines.registry import serving_spec
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.tables import SERVED_SCHEMA, read_table

    layout = LedgerLayout(ledger)
    attached = {}  # name -> (its entry: url and API-key variable, what it said of itself when recorded)
    table = Path(layout.table("served"))
    if table.exists():
        entries = json.loads((ledger / "provenance.json").read_text())["config"]["served"]["servers"]
        for row in read_table(table, SERVED_SCHEMA).to_pylist():
            record = json.loads(row["server_record"])
            if "attached" in record:
                attached.setdefault(row["server"], (entries[row["server"]], record))
    for path in sorted(Path(layout.root, "models").glob("*/model.json")):
        record = json.loads(path.read_text())
        if "attach" in record:
            attached[f"checkpoints.{path.parent.name}.attach"] = (record["attach"], record["server"])
    if not attached:
        return [], ["--servers: the ledger attached to no server (its servers and models were all the workflow's own)"]
    protocol = serving_spec().server_protocol()
    lines, faults = [], []
    for name, (entry, record) in attached.items():
        problem = protocol.attached_still(name, entry, record)
        if problem:
            faults.append(problem)
        else:
            lines.append(f"{name}: the llama-server at {entry['url']} still reports the build and model recorded")
    return lines, faults


def add_verify_command(sub) -> None:
    p = sub.add_parser(
        "verify", help="check a saved ledger without a model: objects, tables, rows, counts (exit 1 on a fault)"
    )
    p.add_argument("ledger_dir", help="the ledger_dir of a run, e.g. ledger")
    p.add_argument("--out", default=None, help="write the verdict here when the ledger is sound")
    p.add_argument(
        "--audit-inputs",
        action="store_true",
        help="check only what the audit reads: not summary.json, the results card or the audit table,"
        " which the workflow rewrites after the audit's check",
    )
    p.add_argument("--inputs", default=None, metavar="ITEMS", help="also say whether this item file is the run's")
    p.add_argument("--config", default=None, metavar="CFG", help="also say whether this config is the run's design")
    p.add_argument(
        "--servers",
        action="store_true",
        help="also ask each attached llama-server the ledger records whether it still reports the recorded build and"
        " model (status requests only)",
    )
    p.set_defaults(func=cmd_verify)


def cmd_show(args) -> None:
    from stagereplay.report.factor_view import ledger_factor_text
    from stagereplay.report.item_view import ledger_item, show_text

    texts = [show_text(record) for record in ledger_item(args.ledger, args.item_id)]
    factors = ledger_factor_text(args.ledger, args.item_id)
    print("\n\n".join(texts + ([factors] if factors else [])))


def add_show_command(sub) -> None:
    p = sub.add_parser(
        "show",
        help="one item of a finished ledger: both suffixes with the first divergence marked, margins, labels, transplants",
    )
    p.add_argument("ledger", help="the ledger_dir of a finished run")
    p.add_argument("item_id", help='an item id (the "id" of a line of LEDGER/items.jsonl)')
    p.set_defaults(func=cmd_show)


def cmd_audit(args) -> None:
    from stagereplay.audit.reproduction import (
        audit_runtime,
        e4_document,
        e4_line,
        e4_summary,
        ledger_table_digests,
        write_e4,
    )
    from stagereplay.audit.rerun import audit_ledger, audit_rows
    from stagereplay.audit.served_audit import audit_served_ledger
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.tables import AUDIT_SCHEMA, read_table, write_table

    rows = audit_rows(audit_ledger(args.ledger, args.checkpoints) + audit_served_ledger(args.ledger))
    audited = LedgerLayout(args.ledger).audit.table("trajectories")
    runtime = audit_runtime(read_table(audited).to_pylist()) if Path(audited).is_file() else None
    figures = e4_summary(rows, runtime)
    write_table(rows, AUDIT_SCHEMA, args.out)
    # e4.json last: it is computed from the audit table (verify recomputes it from there).
    write_e4(e4_document(figures, ledger_table_digests(args.ledger)), args.e4)
    print(e4_line(figures))


def add_audit_command(sub) -> None:
    p = sub.add_parser("audit", help="E4: compare the saved ledger with its recomputation in the audit tree")
    p.add_argument("--ledger", required=True, help="the saved ledger directory")
    p.add_argument("--checkpoints", nargs="+", required=True, help="the checkpoints the run used (their model records)")
    p.add_argument("--out", required=True, help="audit table to write (Parquet)")
    p.add_argument("--e4", required=True, help="E4 figures to write (JSON, beside the audit table: audit/e4.json)")
    p.set_defaults(func=cmd_audit)


def _current_e4(path: str | None, tables: dict) -> dict | None:
    """The E4 figures of e4.json when it was audited against these very tables; None otherwise (the card
    then says "not run", as it did before any audit): a changed ledger is not described by an older audit."""
    from stagereplay.audit.reproduction import e4_describes, e4_summary_of, saved_table_digests

    if not path or not Path(path).is_file():
        return None
    document = json.loads(Path(path).read_bytes())
    if not e4_describes(document, saved_table_digests(tables)):
        print(f"{path} describes an older ledger: E4 is shown as not run until the next audit", file=sys.stderr)
        return None
    return e4_summary_of(document)


def cmd_report(args) -> None:
    from stagereplay.inputs.checkpoints import read_model_record
    from stagereplay.ledger.tables import (
        COMPARISON_SCHEMA,
        FACTOR_SCHEMA,
        SERVED_SCHEMA,
        TRAJECTORY_SCHEMA,
        TRANSPLANT_SCHEMA,
        LedgerError,
        read_table,
    )
    from stagereplay.report.card import write_results_card
    from stagereplay.report.card_provenance import provenance
    from stagereplay.report.controls import check_controls
    from stagereplay.report.factor_view import factor_item_rows
    from stagereplay.report.item_view import item_records, read_vocabularies
    from stagereplay.report.plots import PLOT_FILES, write_plots

    summary_path = Path(args.summary)
    if not summary_path.is_file():
        raise LedgerError(f"{summary_path} not found — run snakemake (rule summary) first")
    summary_bytes = summary_path.read_bytes()
    summary = json.loads(summary_bytes)
    # summarize stops on a failed control already; a summary.json written otherwise is stopped here too.
    check_controls((summary.get("E6") or {}).get("controls"))
    comparisons = read_table(args.comparisons, COMPARISON_SCHEMA)
    trajectories = read_table(args.trajectories, TRAJECTORY_SCHEMA)
    transplants = read_table(args.transplants, TRANSPLANT_SCHEMA) if args.transplants else None
    factors = read_table(args.factors, FACTOR_SCHEMA) if args.factors else None
    records = {name: read_model_record(path) for name, path in args.model}
    served = read_table(args.served, SERVED_SCHEMA) if args.served else None
    saved = {
        "trajectories": trajectories,
        "comparisons": comparisons,
        "transplants": transplants,
        "factors": factors,
        "served": served,
    }
    e4 = _current_e4(args.e4, saved)
    # The card draws E4 from the "E4" entry of the figures it is given; summary.json itself never holds it.
    shown = summary if e4 is None else {**summary, "E4": e4}
    # The plots first: the HTML card carries them inline.
    plots = dict(zip(PLOT_FILES, write_plots(summary, comparisons, trajectories, transplants, args.plots_dir)))
    vocabularies = read_vocabularies(dict(args.vocab))
    items = item_records(summary["checkpoints"], args.items, trajectories, comparisons, transplants, vocabularies)
    factor_items = factor_item_rows(factors, trajectories, vocabularies) if factors is not None else None
    write_results_card(
        shown,
        provenance(summary, args.item_source, args.items, records),
        args.card,
        args.card_html,
        summary_bytes=summary_bytes,
        plots=plots,
        items=items,
        factor_items=factor_items,
    )


def add_report_command(sub) -> None:
    p = sub.add_parser("report", help="write the results card (results.md) and the findings plots from the ledger")
    p.add_argument("--summary", required=True, help="summary.json")
    p.add_argument("--trajectories", required=True)
    p.add_argument("--comparisons", required=True)
    p.add_argument("--transplants", default=None, help="transplants table (absent when E5 is not run)")
    p.add_argument("--factors", default=None, help="factors table (absent when E6 is not run)")
    p.add_argument(
        "--served", default=None, help="served table (absent without served servers): is e4.json of these tables?"
    )
    add_model_records(
        p, "a checkpoint's name and its model.json (repeat for every checkpoint the run used)", required=True
    )
    p.add_argument(
        "--vocab",
        nargs=2,
        action="append",
        required=True,
        metavar=("NAME", "TABLE"),
        help="a checkpoint's name and its vocabulary table, written by the prompts job (repeat per checkpoint)",
    )
    p.add_argument(
        "--e4",
        default=None,
        help="audit/e4.json, when the audit has run: shown on the card if it describes these tables",
    )
    p.add_argument("--items", required=True, help="normalised items.jsonl of the run")
    p.add_argument("--item-source", required=True, help="where the items came from, as configured (recorded)")
    p.add_argument("--card", required=True, help="results card to write (Markdown)")
    p.add_argument("--card-html", default=None, help="the same card as HTML (for the Snakemake report)")
    p.add_argument("--plots-dir", required=True, help="folder for the PNG plots (fixed names)")
    p.set_defaults(func=cmd_report)


COMMANDS = {
    "verify": add_verify_command,
    "show": add_show_command,
    "audit": add_audit_command,
    "report": add_report_command,
}
