"""A finding's directory, `<root>/<id>/`: case.json (the shrunk case), finding.json (its record), report.md,
and the reproducer's files (repro.py, the support module beside it, tensors.safetensors)."""

from __future__ import annotations

from pathlib import Path

from fuzzer.artifacts.finding_report import render_report
from fuzzer.records import Finding, write_finding


def save_finding(finding: Finding, files: dict[str, str], root: Path, tensors: dict | None = None) -> Path:
    """Write `root/<finding.id>/`; `files` maps file names (repro.py, ...) to their text (none: no reproducer)."""
    d = root / finding.id
    d.mkdir(parents=True, exist_ok=True)
    finding.has_repro = "repro.py" in files
    (d / "case.json").write_text(finding.case.to_json() + "\n")
    write_finding(d / "finding.json", finding)
    (d / "report.md").write_text(render_report(finding))
    for name, text in files.items():
        (d / name).write_text(text)
    if tensors:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(d / "tensors.safetensors"))
    return d
