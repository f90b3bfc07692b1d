"""attnfuzz's command line: argparse and the command table. Each command is one module of fuzzer/commands/
with `add_parser(subparsers)` and `main(args, device) -> exit code`.

Exit codes (fuzzer/errors.py): 0 nothing found (or a replayed bug is fixed), 1 findings (or the bug is still
there), 2 usage or environment errors (unknown target, vLLM missing, a malformed case or record), 3 interrupted
(SIGINT or SIGTERM, at any moment: fuzzer/interrupt.py).
"""

from __future__ import annotations

import argparse
import sys
import traceback
import time

STARTED = time.monotonic()  # a run's summary counts its start-up (imports, vLLM's set-up) from here

# Nothing heavy at module level: the signal handlers go in before the commands (torch, Hypothesis) are imported.
from fuzzer import interrupt
from fuzzer.errors import ExitCode, Interrupted, UsageError, VllmCallMoved


# These catch `Interrupted` themselves (a signal that came before they started included: `interrupt.check()`) and
# write what they have, saying it was interrupted; the others end with a line on stderr.
WRITE_WHEN_INTERRUPTED = ("run", "gate", "selftest")


def commands() -> dict:
    from fuzzer.commands import doctor, gate, replay, report, run, selftest  # deferred: the signal handlers go in first
    from fuzzer.commands import list as list_command  # deferred: the signal handlers go in first

    return {"run": run, "replay": replay, "list": list_command, "doctor": doctor, "gate": gate, "selftest": selftest,
            "report": report}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnfuzz", description="Differential fuzzer for vLLM's sparse-MLA backends")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if this host has a GPU")
    sub = p.add_subparsers(dest="command", required=True)
    for command in commands().values():
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # First thing: SIGINT/SIGTERM end the command as interrupted (exit 3) from here on. While the commands import
    # and the arguments are parsed a signal is only recorded; it is raised once the command starts (it knows
    # which outputs to write), and a second one kills at once.
    interrupt.install()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    # The run options as given: a fleet passes them on to its workers.
    args.run_argv = argv[argv.index("run") + 1:] if args.command == "run" else []
    args.started = STARTED
    try:
        from fuzzer.env import prepare_process  # deferred: the signal handlers go in first

        with interrupt.raising():
            if args.command not in WRITE_WHEN_INTERRUPTED:
                interrupt.check()  # a signal that came during the imports
            device = prepare_process(args.device)
            return int(commands()[args.command].main(args, device))
    except UsageError as e:
        print(f"attnfuzz: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except VllmCallMoved as e:  # a target's call into vLLM that this release does not take: nothing was judged
        print(f"attnfuzz {args.command}: COULD NOT TEST {e}", file=sys.stderr)
        return ExitCode.USAGE
    except Interrupted as e:
        print(f"attnfuzz {args.command}: interrupted by {e.signal} before it finished", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except Exception:  # attnfuzz's own fault outside any case: nothing was judged, so never exit 1 ("findings")
        traceback.print_exc()
        print(f"attnfuzz {args.command}: COULD NOT TEST: attnfuzz itself failed (above); exit 2", file=sys.stderr)
        return ExitCode.USAGE


if __name__ == "__main__":
    sys.exit(main())
