"""report.md for one finding: what differed, the shrunk case, versions, device, real vs emulated parts."""

from __future__ import annotations


def render_report(f) -> str:
    h, o = f.host, f.observation
    lines = [
        f"# {f.id}: {f.title}",
        "",
        f"- target: `{f.target}`" + (f" (bug injected: `{f.inject}`)" if f.inject else ""),
        f"- signature: `{f.signature}`",
        f"- bug classes: {', '.join(sorted({v.bug_class for v in f.verdicts if v.bug_class})) or '-'}",
        f"- found after {f.examples_to_find} cases, {f.seconds_to_find:.1f} s; shrunk to: `{f.case.summary()}`",
        f"- host: {h.device} ({h.device_name}), vLLM {h.vllm}, torch {h.torch}, triton {h.triton}, Python {h.python}",
        f"- Triton: {'interpreter (TRITON_INTERPRET=1) with attnfuzz bounds checks' if h.interpreted else 'compiled, native'}",
        f"- real: {', '.join(o.real) or '-'}",
        f"- emulated (attnfuzz stand-ins): {', '.join(o.emulated) or 'none'}",
        "",
        "## What differed",
        "",
    ]
    lines += [f"- **{v.check}**: {v.detail}" for v in f.verdicts]
    if o.error_type:
        lines += ["", f"The call raised `{o.error_type}: {o.error}`:", "", "```", o.notes.get("traceback", "").rstrip(), "```"]
    how = ("python repro.py   # exits 1 while the bug is present, 0 once fixed" if f.has_repro else
           f"attnfuzz replay repros/{f.id}   # this target renders no standalone repro.py yet")
    lines += ["", "## Reproduce", "", "```", how, "```",
              "", "## Case", "", "```json", f.case.to_json(), "```", ""]
    return "\n".join(lines)
