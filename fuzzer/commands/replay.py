"""`attnfuzz replay repros/<id>`: re-run one saved finding on this host."""

from __future__ import annotations

from pathlib import Path

from fuzzer.artifacts import repro
from fuzzer.env import host_info
from fuzzer.errors import ExitCode, UsageError
from fuzzer.mutants import inject
from fuzzer.records import Finding, read_finding
from fuzzer.run.host import import_vllm, make_target
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
    import_vllm()
    target = make_target(record.target, device)
    if record.inject:
        inject(record.inject)
    obs = target.run(case)
    failed = [v for v in target.oracle(case, obs) if not v.ok]
    for v in failed:
        print(f"BUG [{v.check}] {v.detail}")
    if failed and obs.error_type is not None and obs.notes.get("traceback"):
        print(f"where it raised:\n{obs.notes['traceback'].rstrip()}")
    print(f"{record.target} on {case.summary()}: {'still failing' if failed else 'passes (fixed)'}")
    if failed and (args.save_repro or args.standalone):

        finding = Finding(record.target, primary(failed).signature, case, failed, obs,
                          host_info(device, obs.emulated), record.inject, record.examples_to_find,
                          record.seconds_to_find)
        if args.save_repro:
            print(f"reproducer for this host: {repro.write_repro(finding, target, args.save_repro)}/repro.py")
        if args.standalone:
            print(f"standalone reproducer: {repro.write_standalone(finding, target, args.standalone)}")
    return ExitCode.FOUND if failed else ExitCode.CLEAN
