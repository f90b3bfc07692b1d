"""`attnfuzz replay repros/<id>`: re-run one saved finding on this host.

Exit 1: the bug is still there; 0: it passes (fixed); 2: the replay cannot say (checked before vLLM loads where it can:
the case and record, a target this attnfuzz does not know, an injected mutant that is gone, an output directory; then
a target this host or vLLM release cannot run, a mutant that no longer applies, a harness that cannot build the call).
"""

from __future__ import annotations

from pathlib import Path

from fuzzer.commands.outputs import check_outputs
from fuzzer.env import host_info
from fuzzer.errors import ExitCode, HarnessConfigError, UsageError
from fuzzer.mutants import MUTANTS, MutantError, inject
from fuzzer.mutants import load as load_mutant
from fuzzer.records import Finding, read_finding
from fuzzer.run.host import import_vllm, make_target
from fuzzer.targets.registry import TARGETS
from oracles.verdict import primary
from strategies.case import Case, CaseError


def add_parser(sub) -> None:
    rp = sub.add_parser("replay", help="re-run a saved finding (repros/<id>/ or its case.json)")
    rp.add_argument("path", type=Path)
    rp.add_argument("--save-repro", type=Path, metavar="DIR",
                    help="if it still fails here, save this host's reproducer under DIR (e.g. a GPU repro.py for a "
                         "finding made on a CPU)")
    rp.add_argument("--standalone", type=Path, metavar="DIR",
                    help="if it still fails here, write DIR/repro.py in one file (the support code inlined), for an "
                         "upstream bug report")


def check_mutant(name: str, meta_file: Path) -> None:
    """The mutant a finding was made with must still exist: without it the replay would test another program."""
    if name in MUTANTS:
        try:
            load_mutant(name)
        except Exception as e:
            raise UsageError(f"{meta_file}: its injected mutant {name!r} cannot be loaded ({type(e).__name__}: {e})") from e
    elif not Path(name).is_file():
        raise UsageError(f"{meta_file}: its injected mutant {name!r} is missing: neither a built-in mutant nor a file "
                         f"(deleted or renamed?); without it the bug cannot be put back")


def main(args, device: str) -> int:

    path = args.path
    case_file = path / "case.json" if path.is_dir() else path
    if not case_file.is_file():
        raise UsageError(f"{case_file}: no such file")
    try:
        case = Case.from_json(case_file.read_text())
    except CaseError as e:
        raise UsageError(f"{case_file}: {e}") from e
    meta_file = case_file.parent / "finding.json"
    if not meta_file.is_file():
        raise UsageError(f"{meta_file}: no such file (it names the finding's target)")
    record = read_finding(meta_file)
    if record.target not in TARGETS:
        raise UsageError(f"{meta_file}: target {record.target!r} is not one this attnfuzz knows (renamed or removed?); "
                         f"known: {', '.join(TARGETS)}")
    if record.inject:
        check_mutant(record.inject, meta_file)
    check_outputs(dirs={"--save-repro": args.save_repro, "--standalone": args.standalone})
    import_vllm()
    target = make_target(record.target, device)  # names what this host or vLLM release lacks for it
    if record.inject:
        try:
            inject(record.inject)
        except MutantError as e:
            raise UsageError(f"{meta_file}: its injected mutant cannot be applied to this vLLM: {e}") from e
    try:
        obs = target.run(case)
    except HarnessConfigError as e:  # attnfuzz cannot build this release's call: the replay says nothing of the bug
        raise UsageError(f"cannot replay {case_file} here: {e}") from e
    failed = [v for v in target.oracle(case, obs) if not v.ok]
    for v in failed:
        print(f"BUG [{v.check}] {v.detail}")
    if failed and obs.error_type is not None and obs.notes.get("traceback"):
        print(f"where it raised:\n{obs.notes['traceback'].rstrip()}")
    print(f"{record.target} on {case.summary()}: {'still failing' if failed else 'passes (fixed)'}")
    if failed and (args.save_repro or args.standalone):
        from fuzzer.artifacts import repro  # deferred: it imports torch (seconds); argument errors come first

        finding = Finding(record.target, primary(failed).signature, case, failed, obs,
                          host_info(device, obs.emulated), record.inject, record.examples_to_find,
                          record.seconds_to_find)
        if args.save_repro:
            saved = repro.write_repro(finding, target, args.save_repro)
            print(f"reproducer for this host: {saved / 'repro.py'}" if (saved / "repro.py").exists() else
                  f"finding saved: {saved} (this target renders no repro.py; `attnfuzz replay {saved}` re-runs it)")
        if args.standalone:
            print(f"standalone reproducer: {repro.write_standalone(finding, target, args.standalone)}")
    return ExitCode.FOUND if failed else ExitCode.CLEAN
