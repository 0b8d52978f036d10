"""The ``corral`` command: serve, check, relay, exec, call, and the internal runner.

Subcommands import what they need when they run, so the client commands
never import Twisted.
"""

import argparse
import os
import sys

from supervisor import paths


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    from supervisor.config import KEYS

    parser.add_argument(
        "--config", metavar="FILE", help="TOML configuration file (also CORRAL_CONFIG)"
    )
    for key in KEYS:
        parser.add_argument(
            key.flag, dest=key.name, metavar="VALUE",
            help=f"{key.doc} [env {key.env}]",
        )


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--owner", required=True, help="owner name (a user or tenant)")
    parser.add_argument("--conversation", required=True, help="conversation name")
    _add_socket_flag(parser)


def _add_socket_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        default=os.environ.get("CORRAL_SOCKET") or paths.default_socket(),
        help="the supervisor's socket (default: CORRAL_SOCKET or %(default)s)",
    )


def build_parser(with_config_flags: bool = True) -> argparse.ArgumentParser:
    """The argument parser of every subcommand.

    The configuration flags of ``serve`` and ``check`` come from
    ``supervisor.config``, which imports attrs; client commands skip them
    and start faster.
    """
    parser = argparse.ArgumentParser(
        prog="corral",
        description="Execution workspaces for AI-agent runtimes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the supervisor in the foreground")
    check = commands.add_parser(
        "check", help="print the effective configuration and the prerequisites"
    )
    if with_config_flags:
        _add_config_flags(serve)
        _add_config_flags(check)

    relay = commands.add_parser(
        "relay", help="connect stdin/stdout to a conversation's runner (for MCP clients)"
    )
    _add_client_flags(relay)

    execute = commands.add_parser(
        "exec", help="run one command in a conversation and exit with its code"
    )
    _add_client_flags(execute)
    execute.add_argument("--timeout", type=float, help="seconds before the command is killed")
    execute.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")

    call = commands.add_parser("call", help="call one tool and print its result as JSON")
    _add_client_flags(call)
    call.add_argument("tool", help="bash, read, write or edit")
    call.add_argument("arguments", nargs="?", default="{}", help="the tool's arguments as JSON")

    checkpoint = commands.add_parser(
        "checkpoint", help="make a conversation's changes durable (sync them to the store)"
    )
    _add_client_flags(checkpoint)

    delete = commands.add_parser(
        "delete",
        help="delete a conversation, or an owner with all its conversations (admin)",
    )
    delete.add_argument("--owner", required=True, help="owner name")
    delete.add_argument("--conversation", help="conversation name; without it, the whole owner")
    _add_socket_flag(delete)
    cleanup = commands.add_parser(
        "cleanup", help="run the cleanup job now: eviction, retention, garbage (admin)"
    )
    _add_socket_flag(cleanup)

    commands.add_parser(
        "runner", help="(internal) the per-conversation daemon", add_help=False
    )
    return parser


def _load_config(args):
    from supervisor.config import KEYS, load_config

    flags = {key.name: getattr(args, key.name) for key in KEYS}
    return load_config(flags=flags, config_file=args.config)


def main(argv: list[str] | None = None) -> int:
    """Run the ``corral`` command; return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["runner"]:
        from runner.server import main as runner_main

        return runner_main(argv[1:])
    client_command = argv[:1] in (
        ["relay"], ["exec"], ["call"], ["checkpoint"], ["delete"], ["cleanup"]
    )
    args = build_parser(with_config_flags=not client_command).parse_args(argv)
    if args.command in ("serve", "check"):
        from supervisor.errors import ConfigError

        try:
            config = _load_config(args)
            if args.command == "check":
                from supervisor.check import run_check

                return run_check(config)
            from supervisor.serve import run_serve

            return run_serve(config)
        except ConfigError as e:
            print(f"corral {args.command}: {e}", file=sys.stderr)
            return 2
    from supervisor import client

    if args.command == "checkpoint":
        return client.checkpoint_main(args.socket, args.owner, args.conversation)
    if args.command == "delete":
        request = {"admin": "delete", "owner": args.owner}
        if args.conversation:
            request["conversation"] = args.conversation
        return client.admin_main("delete", args.socket, request)
    if args.command == "cleanup":
        return client.admin_main("cleanup", args.socket, {"admin": "cleanup"})
    if args.command == "relay":
        return client.relay_main(args.socket, args.owner, args.conversation)
    if args.command == "exec":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            print("corral exec: give a command after --", file=sys.stderr)
            return 2
        return client.exec_main(
            args.socket, args.owner, args.conversation, command, args.timeout
        )
    return client.call_main(
        args.socket, args.owner, args.conversation, args.tool, args.arguments
    )
