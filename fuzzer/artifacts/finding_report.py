"""report.md for one finding: what differed, the case (shrunk or not), versions, device, real vs emulated parts."""

from __future__ import annotations


def sanitizer_run_line(finding) -> str | None:
    """The command that shows a memory finding made under compute-sanitizer (None for other findings)."""
    tool = finding.observation.notes.get("sanitizer")
    if not tool or not any(v.check == "memory" for v in finding.verdicts):
        return None
    # PyTorch's caching allocator hides out-of-bounds accesses inside its pool (measured: 0 errors with it).
    return f"PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool {tool} python repro.py"


def seen_by(finding) -> str:
    """Who saw the failure: the watchdog (a hang, confirmed on a fresh worker), the worker's death, compute-sanitizer
    (a memory report), the oracle (whatever else failed)."""
    o, checks = finding.observation, {v.check for v in finding.verdicts}
    tool, who = o.notes.get("sanitizer"), []
    if tool and "memory" in checks:
        who.append(f"compute-sanitizer {tool}")
    hang = next((v for v in finding.verdicts if v.check == "hang"), None)
    if hang is not None:
        who.append(f"the watchdog: {hang.detail.split(' (watchdog)')[0]}")
    died = o.error_type == "WorkerCrash" or any(v.where == "device_lost" for v in finding.verdicts)
    if died:
        who.append(f"the campaign: {o.error}" if o.error_type == "WorkerCrash" else
                   "the worker: the case lost the CUDA context")
    if checks - {"memory", "hang"} - ({"crash"} if died else set()):
        who.append("the oracle" + (f" (cases ran under compute-sanitizer {tool})" if tool and "memory" not in checks
                                   else ""))
    return "; ".join(who) or "the oracle"


def case_line(finding) -> str:
    """The case as it was kept: shrunk, its shrink cut short (a signal, a killed campaign), or as first found."""
    case = f"`{finding.case.summary()}`"
    if finding.shrunk:
        return f"shrunk to: {case}"
    notes = finding.observation.notes
    if notes.get("shrink_cut_short"):
        return f"not shrunk to the end (a signal stopped its shrink): the smallest failing case so far, {case}"
    if notes.get("resumed"):
        return f"as a killed campaign left it (its shrink may not have finished): {case}"
    return f"not shrunk (the campaign ran without shrinking, --no-shrink): the case as first found, {case}"


def render_report(f) -> str:
    h, o = f.host, f.observation
    lines = [
        f"# {f.id}: {f.title}",
        "",
        f"- target: `{f.target}`" + (f" (bug injected: `{f.inject}`)" if f.inject else ""),
        f"- signature: `{f.signature}`",
        f"- bug classes: {', '.join(sorted({v.bug_class for v in f.verdicts if v.bug_class})) or '-'}",
        f"- found after {f.examples_to_find} cases, {f.seconds_to_find:.1f} s; {case_line(f)}",
        f"- host: {h.device} ({h.device_name}), vLLM {h.vllm}, torch {h.torch}, triton {h.triton}, Python {h.python}",
        f"- Triton: {'interpreter (TRITON_INTERPRET=1) with attnfuzz bounds checks' if h.interpreted else 'compiled, native'}",
        f"- real: {', '.join(o.real) or '-'}",
        f"- emulated (attnfuzz stand-ins): {', '.join(o.emulated) or 'none'}",
        f"- seen by: {seen_by(f)}"
        + (f" (memcheck re-run: {o.notes['memcheck_rerun']})" if o.notes.get("memcheck_rerun") else ""),
        "- re-runs: " + ("not run" if f.reruns is None else
                         f"FLAKY, came back {f.reruns[0]} of {f.reruns[1]} times" if f.flaky else
                         f"came back {f.reruns[0]} of {f.reruns[1]} times"),
        "",
        "## What differed",
        "",
    ]
    lines += [f"- **{v.check}**: {v.detail}" for v in f.verdicts]
    if o.error_type:
        lines += ["", f"The call raised `{o.error_type}: {o.error}`:", "", "```", o.notes.get("traceback", "").rstrip(), "```"]
    if o.notes.get("log_tail"):  # a crashed or hung worker's last output (its stacks, after the watchdog)
        lines += ["", "The worker's last output:", "", "```", o.notes["log_tail"].rstrip(), "```"]
    if o.notes.get("sanitizer_log"):
        lines += ["", "compute-sanitizer's log for this case:", "", "```", o.notes["sanitizer_log"].rstrip()[-6000:], "```"]
    run = sanitizer_run_line(f)
    how = (f"{run}   # exits 1 while the bug is present, 0 once fixed" if f.has_repro and run else
           "python repro.py   # exits 1 while the bug is present, 0 once fixed" if f.has_repro else
           f"attnfuzz replay repros/{f.id}   # this target renders no standalone repro.py yet")
    lines += ["", "## Reproduce", "", "```", how, "```",
              "", "## Case", "", "```json", f.case.to_json(), "```", ""]
    return "\n".join(lines)


def found_text(f, path=None) -> str:
    """A finding in a few plain lines, as a failing test prints it: where it was saved (None: not yet), its bug
    classes, the case, the primary failed check and how to run the reproducer."""
    classes = ",".join(sorted({v.bug_class for v in f.verdicts if v.bug_class})) or "-"
    injected = f", injected bug {f.inject}" if f.inject else ""
    stand_ins = ", ".join(f.observation.emulated) or "none"
    lines = [f"FOUND {path or f.id}  class {classes} on {f.target}{injected}, after {f.examples_to_find} cases "
             f"({f.seconds_to_find:.1f} s) on vLLM {f.host.vllm} ({f.host.device}; stand-ins for ops this host lacks: "
             f"{stand_ins})",
             f"  {'shrunk case' if f.shrunk else 'case'}: {f.case.summary()}",
             f"  {f.title}"]
    lines += [f"  also: {v.check}: {v.detail}" for v in f.verdicts if v.detail != f.title][:3]
    if path is None:
        lines.append("  reproducer: saved with the final, shrunk case")
    elif f.has_repro:
        lines.append(f"  reproducer: cd {path} && python repro.py   # exits 1 while the bug is present, 0 once fixed")
    else:
        lines.append(f"  reproducer: attnfuzz replay {path}")
    return "\n".join(lines)
