"""A campaign directory and its report: `attnfuzz run --out DIR` writes DIR/campaign.json (what ran, where,
case by case) beside its findings; `attnfuzz report DIR` renders DIR/report.md and DIR/report.html.

campaign.json holds the target, seed, host and versions, the ops that ran for real and the attnfuzz
stand-ins, path coverage (vLLM's paths each case took, `fuzzer/targets/probes.py`), the oracle's error margins per
check as log-scale histograms, and one record per case (summary, seconds, paths, worst margin per check,
verdict signature). The report is self-contained: the HTML holds its CSS and its SVG charts, drawn here.
"""

from __future__ import annotations

import html
import re
import shutil
import time
from pathlib import Path

from fuzzer.errors import RecordError
from fuzzer.records import read_campaign_record, write_campaign_record
from fuzzer.search.caselog import bin_label, bin_order, margin_bin  # noqa: F401  (margin_bin: tests)
from fuzzer.targets.probes import KNOWN_PATHS
from oracles.verdict import Verdict, primary

COPY_LIMIT = 8 << 20  # a finding's files larger than this (tensors) are referenced, not copied


# -- the campaign directory -----------------------------------------------------------------------------------

def write_campaign(out: Path, result, *, host, seed: int, inject: str | None, profile: str, options: dict,
                   findings_saved: list[Path], findings: list | None = None) -> Path:
    """DIR/campaign.json and the findings: referenced where they already lie inside DIR, else copied to
    DIR/findings/<id>/ (files over COPY_LIMIT are referenced, not copied)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for f, saved in zip(result.findings if findings is None else findings, findings_saved):
        saved = Path(saved).resolve()
        entry = dict(f.to_dict(), repro_dir=str(saved))
        try:
            entry["path"] = str(saved.relative_to(out.resolve()))
        except ValueError:  # outside the campaign directory: a copy travels with it
            dest = out / "findings" / saved.name
            dest.mkdir(parents=True, exist_ok=True)
            for p in saved.iterdir():
                if p.is_file() and p.stat().st_size <= COPY_LIMIT:
                    shutil.copy2(p, dest / p.name)
            entry["path"] = str(dest.relative_to(out))
        entries.append(entry)
    log = result.cases
    doc = {
        "target": result.target, "seed": seed, "inject": inject, "profile": profile,
        "options": options, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "examples": result.examples, "seconds": round(result.seconds, 2), "cases_per_second": round(result.rate, 3),
        "workers_started": result.workers_started, "interrupted": result.interrupted,
        "shrink_cases": result.shrink_cases, "rerun_cases": result.rerun_cases, "checks": result.checks,
        "repeats": result.repeats,
        "host": host.to_dict(), "findings": entries, **log.to_dict(),
    }
    path = out / "campaign.json"
    write_campaign_record(path, doc)
    return path


def load_campaign(d: Path) -> dict:
    path = Path(d) / "campaign.json"
    if not path.is_file():
        raise RecordError(f"{path}: no such file (a campaign directory is made by `attnfuzz run --out DIR`)")
    doc = read_campaign_record(path)
    for f in doc["findings"]:
        case = Path(d) / f["path"] / "case.json"
        f["case_json"] = case.read_text().strip() if case.is_file() else None
    return doc


# -- expected vs got, from the oracles' own wording -------------------------------------------------------------

# The oracles name the value they got before the one they expected: oracles/index.py ("X, expected Y"),
# oracles/attention_judge.py ("...: got vs reference", "reads back X ..., written Y", "is X, ... hold Y").
_DIFFS = (
    re.compile(r"(?P<where>.*?)(?P<got>\([^)]*\)|[^\s,;:=]+), expected (?P<exp>\([^)]*\)|[^\s,;)]+)"),
    re.compile(r"(?P<where>worst at [^:]+): (?P<got>\S+) vs (?P<exp>\S+)"),
    re.compile(r"(?P<where>.*?) reads back (?P<got>\S+) (?P<at>at element \d+), written (?P<exp>\S+)"),
    re.compile(r"(?P<where>.*?) is (?P<got>\S+), the cache bytes there hold (?P<exp>\S+)"),
)


def expected_vs_got(detail: str) -> tuple[str, str, str] | None:
    """(where, expected, got) from a verdict's detail, where the oracle states both."""
    for rx in _DIFFS:
        m = rx.search(detail)
        if m:
            where = (m.group("where") + (" " + m.group("at") if "at" in rx.groupindex else "")).strip(" ;,:")
            return where, m.group("exp"), m.group("got")
    return None


# -- Markdown ---------------------------------------------------------------------------------------------------

def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.0f}%" if total else "-"


def _header_rows(doc: dict) -> list[tuple[str, str]]:
    h, o = doc["host"], doc.get("options", {})
    budget = (f"time budget {o['time_budget']:.0f} s" if o.get("time_budget") else
              f"max {o['max_examples']} cases" if o.get("max_examples") else "-")
    rows = [
        ("target", f"{doc['target']}" + (f" (bug injected: {doc['inject']})" if doc.get("inject") else "")),
        ("host", f"{h['device']} ({h['device_name']}), Python {h['python']}"),
        ("versions", f"vLLM {h['vllm']}, torch {h['torch']}, triton {h['triton']}"),
        ("Triton", "interpreter (TRITON_INTERPRET=1) with attnfuzz bounds checks" if h.get("interpreted")
         else "compiled, native"),
        ("seed / profile", f"{doc.get('seed')} / {doc.get('profile')}; {budget}"),
        ("isolation / sanitizer", f"{o.get('isolation', '-')} / {o.get('sanitizer') or 'none'}"),
        ("cases", f"{doc['examples']} in {doc['seconds']:.1f} s ({doc['cases_per_second']:.2f}/s); "
                  f"{doc.get('workers_started', 0)} worker(s) started"),
        ("findings", f"{len(doc['findings'])}" + (f"; later hits of found bugs: {sum(doc['repeats'].values())}"
                                                  if doc.get("repeats") else "")),
        ("stopped" if doc.get("interrupted") else "finished", doc.get("finished", "-")),
    ]
    if doc.get("interrupted"):  # first: no report of a cut-short run may read as a finished clean one
        rows.insert(0, ("INTERRUPTED", _interrupted(doc)))
    return rows


def _interrupted(doc: dict) -> str:
    """What an interrupted campaign's report says first: it did not finish, and what ran."""
    how = f"by {doc['interrupted']}" if isinstance(doc["interrupted"], str) else ""
    if not doc["examples"]:
        return f"{how} in start-up, before the first case: nothing was tested".strip()
    return f"{how} after {doc['examples']} case(s): the search did not finish".strip()


def _no_findings(doc: dict) -> str:
    """The findings section of a campaign that found nothing."""
    if doc.get("interrupted"):
        return f"None found, but the campaign was interrupted {_interrupted(doc)}."
    return "None: every case passed every check."


def _margin_table(doc: dict) -> dict[str, list[tuple[str, int]]]:
    return {check: sorted(bins.items(), key=lambda kv: bin_order(kv[0])) for check, bins in sorted(doc["margins"].items())}


def _case_label(f: dict) -> str:
    """What a finding's case is: shrunk, or kept unshrunk (--no-shrink, a shrink cut short); a record older than
    the `shrunk` field says neither."""
    return {True: "shrunk case", False: "case (not shrunk)"}.get(f.get("shrunk"), "case")


def render_markdown(doc: dict) -> str:
    n = doc["examples"]
    out = [f"# attnfuzz campaign: {doc['target']}{' (INTERRUPTED)' if doc.get('interrupted') else ''}", "", "| | |",
           "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in _header_rows(doc)]
    out += ["", f"## Findings ({len(doc['findings'])})", ""]
    if not doc["findings"]:
        out += [_no_findings(doc), ""]
    for f in doc["findings"]:
        out += [f"### {f['id']}: {_title(f)}", "",
                f"- classes: {', '.join(f['bug_classes']) or '-'}; signature `{f['signature']}`",
                f"- found after {f['examples_to_find']} cases ({f['seconds_to_find']} s); "
                + ("re-runs: not run" if not f.get("reruns") else
                   f"came back {f['reruns']['reproduced']} of {f['reruns']['of']} re-runs"
                   + (" (FLAKY)" if f["reruns"]["flaky"] else "")),
                f"- {_case_label(f)}: `{f['summary']}`",
                f"- reproducer: [{f['path']}/repro.py]({f['path']}/repro.py), report [{f['path']}/report.md]({f['path']}/report.md)",
                ""]
        for v in f["verdicts"]:
            out.append(f"- **{v['check']}** ({v.get('bug_class') or '-'}): {v['detail']}")
            d = expected_vs_got(v["detail"])
            if d:
                out += ["", "  ```diff", f"  @@ {d[0]} @@", f"  - expected: {d[1]}", f"  + got:      {d[2]}", "  ```"]
        if f.get("error"):
            out += ["", f"The call raised `{f['error']}`."]
        if f.get("case_json"):
            out += ["", "<details><summary>case.json</summary>", "", "```json", f["case_json"], "```", "", "</details>"]
        out.append("")
    out += ["## Path coverage", "", f"vLLM's paths the {n} cases took (recorded by wrapping vLLM's own functions).", "",
            "| path | cases | share | first at case |", "|---|---:|---:|---:|"]
    out += [f"| `{p}` | {c} | {_pct(c, n)} | {doc['first_seen'].get(p, '-')} |" for p, c in doc["coverage"].items()]
    never = _never_taken(doc)
    if never:
        out += ["", "Never taken here: " + ", ".join(f"`{p}`" for p in never)]
    out += ["", f"Distinct path sets: {len(doc['path_sets'])}. Most common:", "", "| cases | paths |", "|---:|---|"]
    out += [f"| {c} | {s} |" for s, c in list(doc["path_sets"].items())[:8]]
    out += _combinations_markdown(doc)
    out += ["", "## Error margins", "", "Worst error / tolerance per case and check where the oracle measured one "
            "(<= 1 passes), in half-decade bins.", ""]
    margins = _margin_table(doc)
    if not margins:
        out += ["No numeric checks on this target (its checks are exact).", ""]
    for check, bins in margins.items():
        out += [f"**{check}** ({sum(c for _, c in bins)} cases)", "", "| margin from | cases |", "|---:|---:|"]
        out += [f"| {bin_label(k)} | {c} |" for k, c in bins] + [""]
    out += ["## Checks", "", "| check | passed | failed |", "|---|---:|---:|"]
    for check, ok, bad in _checks(doc):
        out.append(f"| {check} | {ok} | {bad} |")
    out += ["", "## Real vs stand-in", "", "| part | kind | cases |", "|---|---|---:|"]
    out += [f"| {p} | vLLM, real | {c} |" for p, c in doc.get("real", {}).items()]
    out += [f"| {p} | attnfuzz stand-in | {c} |" for p, c in doc.get("emulated", {}).items()]
    out += [f"| {p} | CPU shim / interpreter correction | {c} |" for p, c in doc.get("shims", {}).items()]
    out.append("")
    return "\n".join(out)


def _combinations_markdown(doc: dict) -> list[str]:
    c = doc.get("combinations")
    if not c:
        return []
    out = ["", "## Knob combinations", "",
           f"Pairs of knob categories covered: {c['pairs']['covered']} of {c['pairs']['total']} "
           f"({_pct(c['pairs']['covered'], c['pairs']['total'])}); triples: {c['triples']['covered']} of "
           f"{c['triples']['total']} ({_pct(c['triples']['covered'], c['triples']['total'])}) (the totals count "
           f"combinations the strategies cannot make); pairs of a vLLM path and a category: {c['path_pairs']}; "
           f"batches under a swarm: {c['swarms']}.", "", "| knob | cases per category |", "|---|---|"]
    out += [f"| `{k}` | " + ", ".join(f"{v} {n}" for v, n in cats.items()) + " |" for k, cats in c["knobs"].items()]
    return out


def _title(finding: dict) -> str:
    """The finding's primary symptom, as `Finding.title` names it."""

    return primary([Verdict(**v) for v in finding["verdicts"]]).detail if finding["verdicts"] else finding["signature"]


def _checks(doc: dict) -> list[tuple[str, int, int]]:
    names = sorted({k.rsplit(":", 1)[0] for k in doc.get("checks", {})})
    return [(c, doc["checks"].get(f"{c}:ok", 0), doc["checks"].get(f"{c}:FAIL", 0)) for c in names]


def _never_taken(doc: dict) -> list[str]:

    return [p for p in KNOWN_PATHS if p not in doc["coverage"]]


# -- SVG charts (drawn here: no plotting library) ---------------------------------------------------------------

def _svg_bars(bins: list[tuple[str, int]], width: int = 520, height: int = 170) -> str:
    """A histogram over margin bins; bins of margins > 1 (failing) in red, a line at margin 1."""
    if not bins:
        return ""
    keys = [k for k, _ in bins]
    ks = [int(k) for k in keys if k not in ("zero", "nonfinite")]
    if ks:  # every half-decade between the smallest and largest, empty ones included
        full = ([("zero", dict(bins)["zero"])] if "zero" in keys else []) + \
               [(str(k), dict(bins).get(str(k), 0)) for k in range(min(min(ks), -1), max(max(ks), 0) + 1)] + \
               ([("nonfinite", dict(bins)["nonfinite"])] if "nonfinite" in keys else [])
    else:
        full = bins
    left, bottom, top = 40, 34, 12
    w = (width - left - 24) / len(full)
    peak = max(c for _, c in full) or 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" class="chart" role="img">',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - 10}" y2="{height - bottom}" class="axis"/>',
             f'<text x="{left - 6}" y="{top + 8}" class="tick" text-anchor="end">{peak}</text>',
             f'<text x="{left - 6}" y="{height - bottom}" class="tick" text-anchor="end">0</text>']
    for i, (k, c) in enumerate(full):
        h = (height - bottom - top) * c / peak
        x = left + i * w
        failing = k == "nonfinite" or (k != "zero" and int(k) >= 0)
        parts.append(f'<rect x="{x + 1:.1f}" y="{height - bottom - h:.1f}" width="{max(w - 2, 1):.1f}" height="{h:.1f}" '
                     f'class="{"bad" if failing else "good"}"><title>{html.escape(bin_label(k))}: {c} cases</title></rect>')
        if len(full) <= 14 or i % 2 == 0:  # each bin's lower edge, under the boundary
            parts.append(f'<line x1="{x:.1f}" y1="{height - bottom}" x2="{x:.1f}" y2="{height - bottom + 4}" class="axis"/>'
                         f'<text x="{x:.1f}" y="{height - bottom + 15}" class="tick" text-anchor="middle">'
                         f'{html.escape(bin_label(k))}</text>')
        if k == "0":  # margin 1: where the tolerance ends
            parts.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - bottom}" class="limit"/>'
                         f'<text x="{x + 3:.1f}" y="{top + 4}" class="tick">tolerance</text>')
    last = full[-1][0]
    if last not in ("zero", "nonfinite") and int(last) < 8:  # the last bin's upper edge
        x = left + len(full) * w
        parts.append(f'<line x1="{x:.1f}" y1="{height - bottom}" x2="{x:.1f}" y2="{height - bottom + 4}" class="axis"/>'
                     f'<text x="{x:.1f}" y="{height - bottom + 15}" class="tick" text-anchor="middle">'
                     f'{html.escape(bin_label(str(int(last) + 1)))}</text>')
    parts.append(f'<text x="{left + (width - left) / 2:.0f}" y="{height - 4}" class="tick" text-anchor="middle">'
                 f'error / tolerance (log scale; {sum(c for _, c in full)} cases)</text></svg>')
    return "".join(parts)


def _svg_growth(doc: dict, width: int = 440, height: int = 170) -> str:
    """Distinct paths seen against cases run: where the search stopped finding new ones."""
    n = doc["examples"]
    firsts = sorted(doc.get("first_seen", {}).values())
    if not n or not firsts:
        return ""
    left, bottom, top = 40, 30, 10
    sx = (width - left - 10) / n
    sy = (height - bottom - top) / len(firsts)
    pts, y = [f"{left:.1f},{height - bottom:.1f}"], 0
    for i, first in enumerate(firsts, start=1):
        x = left + (first - 1) * sx
        pts += [f"{x:.1f},{height - bottom - y * sy:.1f}", f"{x:.1f},{height - bottom - i * sy:.1f}"]
        y = i
    pts.append(f"{left + n * sx:.1f},{height - bottom - y * sy:.1f}")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" class="chart" role="img">'
            f'<line x1="{left}" y1="{height - bottom}" x2="{width - 10}" y2="{height - bottom}" class="axis"/>'
            f'<polyline points="{" ".join(pts)}" class="growth"/>'
            f'<text x="{left - 6}" y="{top + 8}" class="tick" text-anchor="end">{len(firsts)}</text>'
            f'<text x="{left - 6}" y="{height - bottom}" class="tick" text-anchor="end">0</text>'
            f'<text x="{width - 10}" y="{height - bottom + 13}" class="tick" text-anchor="end">{n}</text>'
            f'<text x="{left + (width - left) / 2:.0f}" y="{height - 4}" class="tick" text-anchor="middle">'
            f'cases run → distinct paths taken</text></svg>')


def _hbar(frac: float) -> str:
    return f'<span class="hbar"><span style="width:{100 * frac:.1f}%"></span></span>'


# -- HTML -------------------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#1f2328;max-width:1180px;margin:24px auto;padding:0 20px}
h1{font-size:22px;margin:0 0 12px}h2{font-size:17px;border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:18px 0 6px}code,pre{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:8px 10px;overflow-x:auto;white-space:pre-wrap}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}table.kv td:first-child{font-weight:600;background:#f6f8fa}
.finding{border:1px solid #d0d7de;border-left:4px solid #cf222e;border-radius:6px;padding:6px 14px 10px;margin:12px 0}
.clean{border-left:4px solid #1a7f37;padding:4px 12px;background:#dafbe1;border-radius:6px}
.interrupted{border-left:4px solid #9a6700;padding:4px 12px;background:#fff8c5;border-radius:6px}
.badge{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;background:#ddf4ff;color:#0969da;margin-right:4px}
.badge.cls{background:#ffebe9;color:#cf222e}.diff{margin:4px 0 8px}.diff div{font:12px ui-monospace,Menlo,monospace;padding:1px 8px}
.diff .exp{background:#dafbe1;color:#116329}.diff .got{background:#ffebe9;color:#82071e}.diff .at{color:#57606a;background:#f6f8fa}
.hbar{display:inline-block;width:140px;height:10px;background:#eaeef2;border-radius:3px;vertical-align:middle}
.hbar span{display:block;height:10px;background:#0969da;border-radius:3px}.muted{color:#57606a}
.charts{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}.charts figure{margin:0}.charts figcaption{font-weight:600;margin-bottom:2px}
svg.chart .axis{stroke:#57606a}svg.chart .tick{font-size:10px;fill:#57606a}svg.chart .good{fill:#2da44e}
svg.chart .bad{fill:#cf222e}svg.chart .limit{stroke:#cf222e;stroke-dasharray:3 3}svg.chart .growth{fill:none;stroke:#0969da;stroke-width:2}
.cols{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
"""


def _e(x) -> str:
    return html.escape(str(x))


def render_html(doc: dict) -> str:
    n = doc["examples"]
    body = [f"<h1>attnfuzz campaign: <code>{_e(doc['target'])}</code>{' (INTERRUPTED)' if doc.get('interrupted') else ''}"
            f"</h1>", '<table class="kv">']
    body += [f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in _header_rows(doc)] + ["</table>"]

    body.append(f"<h2>Findings ({len(doc['findings'])})</h2>")
    if not doc["findings"]:
        body.append(f'<p class="{"interrupted" if doc.get("interrupted") else "clean"}">{_e(_no_findings(doc))}</p>')
    for f in doc["findings"]:
        title = _title(f)
        reruns = ("re-runs: not run" if not f.get("reruns") else
                  f"came back {f['reruns']['reproduced']} of {f['reruns']['of']} re-runs"
                  + (" (FLAKY)" if f["reruns"]["flaky"] else ""))
        body += ['<div class="finding">', f"<h3>{_e(f['id'])}: {_e(title)}</h3>", "<p>"]
        body += [f'<span class="badge cls">class {_e(c)}</span>' for c in f["bug_classes"]]
        body += [f'<span class="badge">{_e(f["signature"])}</span>',
                 f"found after {f['examples_to_find']} cases ({f['seconds_to_find']} s); {_e(reruns)}.<br>",
                 f"{_case_label(f).capitalize()}: <code>{_e(f['summary'])}</code><br>",
                 f'Reproducer: <a href="{_e(f["path"])}/repro.py"><code>{_e(f["path"])}/repro.py</code></a> '
                 f'(exits 1 while the bug is present), <a href="{_e(f["path"])}/report.md">report.md</a></p>', "<ul>"]
        for v in f["verdicts"]:
            body.append(f"<li><b>{_e(v['check'])}</b> ({_e(v.get('bug_class') or '-')}): {_e(v['detail'])}")
            d = expected_vs_got(v["detail"])
            if d:
                body.append(f'<div class="diff"><div class="at">{_e(d[0])}</div><div class="exp">expected: {_e(d[1])}</div>'
                            f'<div class="got">got:&nbsp;&nbsp;&nbsp;&nbsp;&nbsp; {_e(d[2])}</div></div>')
            body.append("</li>")
        body.append("</ul>")
        if f.get("error"):
            body.append(f"<p>The call raised <code>{_e(f['error'])}</code>.</p>")
        if f.get("case_json"):
            body.append(f"<details><summary>case.json</summary><pre>{_e(f['case_json'])}</pre></details>")
        body.append("</div>")

    body += ["<h2>Path coverage</h2>",
             f'<p class="muted">vLLM\'s paths the {n} cases took, recorded by wrapping vLLM\'s own functions; '
             "Hypothesis is steered toward the rarely taken ones.</p>", '<div class="cols"><table>',
             "<tr><th>path</th><th>cases</th><th>share</th><th>first at case</th></tr>"]
    for p, c in doc["coverage"].items():
        body.append(f"<tr><td><code>{_e(p)}</code></td><td class=n>{c}</td><td>{_hbar(c / n if n else 0)} "
                    f"{_pct(c, n)}</td><td class=n>{_e(doc['first_seen'].get(p, '-'))}</td></tr>")
    body.append("</table>")
    growth = _svg_growth(doc)
    if growth:
        body.append(f"<figure><figcaption><b>Coverage growth</b></figcaption>{growth}</figure>")
    body.append("</div>")
    never = _never_taken(doc)
    if never:
        body.append('<p class="muted">Never taken here: ' + ", ".join(f"<code>{_e(p)}</code>" for p in never) + "</p>")
    body += [f"<h3>Path sets ({len(doc['path_sets'])} distinct; most common)</h3>", "<table>",
             "<tr><th>cases</th><th>paths</th></tr>"]
    body += [f"<tr><td class=n>{c}</td><td><code>{_e(s)}</code></td></tr>" for s, c in list(doc["path_sets"].items())[:8]]
    body.append("</table>")

    c = doc.get("combinations")
    if c:
        body += ["<h2>Knob combinations</h2>",
                 f"<p>Pairs of knob categories covered: {c['pairs']['covered']} of {c['pairs']['total']} "
                 f"{_hbar(c['pairs']['covered'] / max(1, c['pairs']['total']))} {_pct(c['pairs']['covered'], c['pairs']['total'])}; "
                 f"triples: {c['triples']['covered']} of {c['triples']['total']} "
                 f"{_hbar(c['triples']['covered'] / max(1, c['triples']['total']))} "
                 f"{_pct(c['triples']['covered'], c['triples']['total'])}.</p>",
                 f'<p class="muted">The totals count combinations the strategies cannot make. Pairs of a vLLM path and '
                 f"a category: {c['path_pairs']}; batches under a swarm: {c['swarms']}.</p>",
                 "<table><tr><th>knob</th><th>cases per category</th></tr>"]
        body += [f"<tr><td><code>{_e(k)}</code></td><td>" + ", ".join(f"{_e(v)} {n}" for v, n in cats.items())
                 + "</td></tr>" for k, cats in c["knobs"].items()]
        body.append("</table>")
    body += ["<h2>Checks and error margins</h2>",
             '<p class="muted">Each check\'s verdicts, and the worst error / tolerance per case where the oracle '
             "measured one (&le; 1 passes), in half-decade bins.</p>", '<div class="charts"><table>',
             "<tr><th>check</th><th>passed</th><th>failed</th></tr>"]
    body += [f"<tr><td>{_e(c)}</td><td class=n>{ok}</td><td class=n>{bad}</td></tr>" for c, ok, bad in _checks(doc)]
    body.append("</table>")
    margins = _margin_table(doc)
    for check, bins in margins.items():
        body.append(f"<figure><figcaption>{_e(check)} ({sum(c for _, c in bins)} cases)</figcaption>{_svg_bars(bins)}</figure>")
    if not margins:
        body.append("<p>No numeric checks on this target (its checks are exact).</p>")
    body.append("</div>")

    body += ["<h2>Real vs stand-in</h2>", "<table><tr><th>part</th><th>kind</th><th>cases</th></tr>"]
    for key, kind in (("real", "vLLM, real"), ("emulated", "attnfuzz stand-in"), ("shims", "CPU shim / correction")):
        body += [f"<tr><td>{_e(p)}</td><td>{kind}</td><td class=n>{c}</td></tr>" for p, c in doc.get(key, {}).items()]
    body.append("</table>")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>attnfuzz: {_e(doc['target'])}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def render(d: Path) -> tuple[Path, Path]:
    """DIR/report.md and DIR/report.html from DIR/campaign.json."""
    doc = load_campaign(d)
    md, page = Path(d) / "report.md", Path(d) / "report.html"
    md.write_text(render_markdown(doc))
    page.write_text(render_html(doc))
    return md, page
