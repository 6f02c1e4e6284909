"""The `turnout` command. Each subcommand lives in its own module with add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from turnout import envs

SUBCOMMANDS = {
    "generate": ("turnout.entrypoints.generate_cmd", "generate text offline"),
    "serve": ("turnout.entrypoints.openai.serve_cmd", "run the OpenAI-compatible server"),
    "bench": ("turnout.entrypoints.bench_cmd", "latency / throughput benchmarks"),
    "ops": ("turnout.entrypoints.ops_cmd", "show (and check) the op dispatch table of this machine"),
    "models": ("turnout.entrypoints.models_cmd", "the architectures and how each runs here (and --check them)"),
}


def _add_global_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """Flags every subcommand takes, before it (``turnout --log-level X generate``) or after it
    (``turnout generate --log-level X``). Below the top the default is SUPPRESS, so a subcommand's parser
    never overwrites a value given before the subcommand with its own default."""
    parser.add_argument("--log-level", default="INFO" if top else argparse.SUPPRESS,
                        help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")


def _subparsers(parser: argparse.ArgumentParser):
    """Every parser below ``parser`` (``bench latency`` is two levels down)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield child
                yield from _subparsers(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnout", description="A portable LLM inference engine.")
    _add_global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    for p in _subparsers(parser):
        if "--log-level" not in p._option_string_actions:  # a subcommand may define its own
            _add_global_flags(p, top=False)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` chose (``bench latency`` is two levels down)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) not in sub.choices:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """``parser.parse_args``, but an unknown option is an error naming the command's closest one
    (``--tensor-paralel-size``: did you mean ``--tensor-parallel-size``?)."""
    from turnout.config import unknown_option

    args, extra = parser.parse_known_args(argv)
    if extra:
        command = _command_parser(parser, args)
        known = [s for s in command._option_string_actions if s.startswith("--")]
        for token in extra:
            if token.startswith("-") and len(token) > 1:
                command.error(str(unknown_option(token.split("=", 1)[0], known)))
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        envs.get()  # the environment, read once at start-up: a malformed variable is one line naming it
    except ValueError as e:
        print(f"turnout: error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parse_args(parser, argv)
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int):
        parser.error(f"--log-level: unknown level {args.log_level!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if level > logging.DEBUG:  # httpx logs every request at INFO (bench serve sends thousands): not a server's log
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ValueError, RuntimeError) as e:
        # User mistakes and start-up failures: one clear line, no traceback.
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"turnout {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
