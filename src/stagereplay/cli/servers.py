"""Servers as deployed or attached: what one allows (probe), and whole requests served on one (served)."""

from __future__ import annotations

import json


def cmd_probe(args) -> None:
    from stagereplay.engines.registry import serving_spec

    print(serving_spec().server_protocol().probe_text(args.url, tuple(args.slots), args.api_key_env, args.timeout))


def add_probe_command(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="say what a running llama-server allows (experiments, E6 levels) before attaching a run to it;"
        " it sends status requests only and writes nothing on the server",
    )
    p.add_argument("url", help="the server's address, http://HOST:PORT")
    p.add_argument(
        "--slots",
        type=int,
        nargs="+",
        default=[0],
        help="the slots a run may use (default: 0); a guest uses no other",
    )
    p.add_argument(
        "--api-key-env",
        default=None,
        help="the environment variable holding the server's API key, where it wants one (never the key itself)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a request may take (default: 30)")
    p.set_defaults(func=cmd_probe)


def cmd_served(args) -> None:
    from stagereplay.experiments.served import ServedDesign, run_served
    from stagereplay.inputs.checkpoints import read_model_record

    design = ServedDesign(
        tokens=args.tokens,
        clients=args.clients,
        seed=args.seed,
        load_runs=args.load_runs,
        boundary=args.boundary,
        each_slot=args.each_slot,
        kv_offsets=tuple(args.kv_offset),
        send_as=tuple(args.send_as or ("pinned",)),
        sampling=args.sampling,
    )
    record = read_model_record(args.model_record)
    entry = json.loads(args.server_spec)
    run_served(record, args.prompts, args.server, entry, design, args.out, args.recorded, args.vocab, args.items)


def add_served_command(sub) -> None:
    p = sub.add_parser(
        "served",
        help="serve every item on one llama-server, deployed (started here with its defaults and the given flags)"
        " or attached (at its URL): alone, again, amid other clients, as a prompt-cache hit",
    )
    p.add_argument("--model-record", required=True, help="the primary checkpoint's model.json: its GGUF")
    p.add_argument("--prompts", required=True, help="its prompt tokens table (Parquet)")
    p.add_argument(
        "--vocab", default=None, help="its vocabulary table: an attached server's spellings are checked against it"
    )
    p.add_argument("--server", required=True, help="the server's name in served.servers")
    p.add_argument(
        "--server-spec", required=True, help="its entry, as JSON: {flags: [...]} or {url: ..., slots: [...]}"
    )
    p.add_argument("--tokens", type=int, required=True, help="greedy tokens per request")
    p.add_argument("--clients", type=int, required=True, help="other clients amid which the item is served")
    p.add_argument("--seed", type=int, required=True, help="the load schedule's seed")
    p.add_argument("--load-runs", type=int, required=True, help="load schedules per item")
    p.add_argument(
        "--boundary", type=int, required=True, help="the stage boundary (stage.max_new_tokens): where a replay starts"
    )
    p.add_argument("--each-slot", action="store_true", help="the request alone on each slot in turn (cell slot)")
    p.add_argument(
        "--kv-offset", type=int, action="append", default=[], help="C: the item alone behind another slot's C cells"
    )
    p.add_argument(
        "--send-as",
        action="append",
        choices=("pinned", "default"),
        help="a client that sends every cell (repeatable; default: pinned): pinned token ids, or an OpenAI-style client",
    )
    p.add_argument(
        "--sampling",
        type=json.loads,
        default={},
        help='how each token is picked, as JSON: {"temperature": 1.0, "seed": 42} (top_k, top_p optional);'
        " default greedy",
    )
    p.add_argument("--items", default=None, help="the run's items.jsonl: the default client's chat messages")
    p.add_argument("--out", required=True, help="the server's table (Parquet)")
    p.add_argument(
        "--recorded", default=None, help="the audit's: the saved table of this server, whose record it must still match"
    )
    p.set_defaults(func=cmd_served)


COMMANDS = {"probe": add_probe_command, "served": add_served_command}
