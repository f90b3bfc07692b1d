"""Print a Markdown table from the --json summaries of a results directory."""

import json
import sys
from pathlib import Path

rows = ["| run | vLLM | device | cases | s | cases/s | findings (cases / s to find; shrunk case) |", "|---|---|---|---|---|---|---|"]
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    d = json.loads(p.read_text())
    found = "; ".join(f"{f['bug_classes']} {f['examples_to_find']} / {f['seconds_to_find']} s; `{f['summary']}`"
                      for f in d["findings"]) or "none"
    rows.append(f"| {p.stem} | {d['host']['vllm']} | {d['host']['device_name']} | {d['examples']} | {d['seconds']} "
                f"| {d['cases_per_second']} | {found} |")
print("\n".join(rows))
