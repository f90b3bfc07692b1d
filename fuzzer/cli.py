"""attnfuzz's command line: argparse and the command table. Each command is one module of fuzzer/commands/
with `add_parser(subparsers)` and `main(args, device) -> exit code`.

Exit codes (fuzzer/errors.py): 0 nothing found (or a replayed bug is fixed), 1 findings (or the bug is still
there), 2 usage or environment errors (unknown target, vLLM missing, a malformed case or record).
"""

from __future__ import annotations

import argparse
import sys
import time

STARTED = time.monotonic()  # a run's summary counts its start-up (imports, vLLM's set-up) from here

from fuzzer.commands import gate, replay, report, run, selftest
from fuzzer.commands import list as list_command
from fuzzer.env import prepare_process
from fuzzer.errors import ExitCode, UsageError

COMMANDS = {"run": run, "replay": replay, "list": list_command, "gate": gate, "selftest": selftest,
            "report": report}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnfuzz", description="Differential fuzzer for vLLM's sparse-MLA backends")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if this host has a GPU")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    # The run options as given: a fleet passes them on to its workers.
    args.run_argv = argv[argv.index("run") + 1:] if args.command == "run" else []
    args.started = STARTED
    try:
        device = prepare_process(args.device)
        return int(COMMANDS[args.command].main(args, device))
    except UsageError as e:
        print(f"attnfuzz: {e}", file=sys.stderr)
        return ExitCode.USAGE


if __name__ == "__main__":
    sys.exit(main())
