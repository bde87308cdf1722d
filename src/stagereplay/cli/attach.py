"""A llama-server someone else runs: what it allows, before a run attaches to it."""

from __future__ import annotations


def cmd_probe(args) -> None:
    from stagereplay.engines.llamaserver.attached import AttachedServer, api_key_from
    from stagereplay.engines.llamaserver.probe import probe

    server = AttachedServer(
        args.url,
        api_key=api_key_from(args.api_key_env, "--api-key-env"),
        slots=tuple(args.slots),
        request_timeout=args.timeout,
    )
    print(probe(server).render())


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


COMMANDS = {"probe": add_probe_command}
