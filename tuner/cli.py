"""The ``kvtune`` command: parses arguments and hands them to a command module.

``kvtune --gpu GPU --workload TRACE ...`` (no subcommand) runs the tuner; ``kvtune NAME ...`` runs the
subcommand ``NAME``. Each command is a module of :mod:`kvtune.tuner.commands` with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Errors the user caused print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from kvtune import __version__
from kvtune.kernels.backend import kernel_choice

TUNE = "tune"
COMMANDS: tuple[str, ...] = ("check", "replay", "quality", "gpus", "export", "dashboard")
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"kvtune.tuner.commands.{name}")


def _parser(module: ModuleType, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=module.HELP)
    module.add_arguments(parser)
    return parser


def _top_help() -> str:
    lines = [
        f"kvtune {__version__}: tune a hybrid KV cache for one GPU model and one real workload.",
        "",
        "usage: kvtune --gpu GPU --workload TRACE [options]   (run a tuning study; kvtune tune --help)",
        "       kvtune COMMAND [options]                     (kvtune COMMAND --help)",
        "",
        "commands:",
    ]
    for name in COMMANDS:
        lines.append(f"  {name:<10} {_load(name).HELP}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_top_help())
        return 0
    if args[0] == "--version":
        print(f"kvtune {__version__}")
        return 0
    name, rest = (args[0], args[1:]) if args[0] in (*COMMANDS, TUNE) else (TUNE, args)
    module = _load(name)
    prog = "kvtune" if name == TUNE and args[0] != TUNE else f"kvtune {name}"
    parsed = _parser(module, prog).parse_args(rest)
    try:
        kernel_choice()  # a bad KVTUNE_KERNELS fails here, not in every trial
        return int(module.run(parsed))
    except USER_ERRORS as e:
        print(f"kvtune: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
