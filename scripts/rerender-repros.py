#!/usr/bin/env python3
"""Re-render the reproducers of saved findings (repros/<id>/ by default) after the renderer changed: repro.py,
attnfuzz_support.py and tensors.safetensors from each finding's case.json and finding.json, on the host the
finding was made on (its inputs are drawn again from the case's seed). finding.json, case.json and report.md
are kept; the id in repro.py stays the directory's. Run it in a venv of the release the finding was found on
(finding.json's host.vllm): the call is rendered for the API the running vLLM has. Check each afterwards on
the releases its finding.json names (`python repro.py` exits 1 where "present", 0 where "absent").

  .venv-0.26.0/bin/python scripts/rerender-repros.py repros/<id> [...]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzzer.env import prepare_process  # noqa: E402


def rerender(d: Path) -> None:
    from fuzzer.artifacts.repro import SUPPORT_FILE, render
    from fuzzer.observation import Observation
    from fuzzer.records import Finding, read_finding
    from fuzzer.run.host import make_target
    from strategies.case import Case

    record = read_finding(d)
    import vllm

    if record.host.get("vllm") and record.host["vllm"] != vllm.__version__:
        print(f"{d}: found on vLLM {record.host['vllm']}, rendering with {vllm.__version__}: the call follows this "
              f"release's API", file=sys.stderr)
    case = Case.from_json((d / "case.json").read_text())
    finding = Finding.from_record(record, case)
    # What the renderer reads of the observation: whether the interpreter's bounds checks saw something.
    finding.observation = Observation(record.target, finding.host.device, memory=list(record.raw.get("memory", [])))
    target = make_target(record.target, finding.host.device)
    spec = target.repro_spec(finding)
    if spec is None:
        print(f"{d}: {record.target} renders no reproducer (replay it: attnfuzz replay {d})")
        return
    files = render(finding, spec)
    files["repro.py"] = files["repro.py"].replace(finding.id, record.id)
    for name, text in files.items():
        (d / name).write_text(text)
    if SUPPORT_FILE not in files:
        (d / SUPPORT_FILE).unlink(missing_ok=True)
    if spec.tensors:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in spec.tensors.items()}, str(d / "tensors.safetensors"))
    print(f"{d}: repro.py {len(files['repro.py'].splitlines())} lines")


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or sorted(p.parent for p in (ROOT / "repros").glob("*/finding.json"))
    prepare_process("cpu")
    for d in dirs:
        rerender(d)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
