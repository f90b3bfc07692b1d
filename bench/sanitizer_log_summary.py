#!/usr/bin/env python3
"""Summarize compute-sanitizer logs too large to bring back from the GPU host: the log is cut at its marker
lines (a worker's case markers, bench/initcheck_stages.py's STAGE and CASE lines); after each marker, how many
reports of each signature followed it; then, once per signature, the first report as logged (host frames too).

  python3 bench/sanitizer_log_summary.py TOOL LOG... > summary.txt
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzzer.run.compute_sanitizer import parse_log  # noqa: E402
from fuzzer.run.worker import BEGIN, END  # noqa: E402

MARKER = re.compile(rf"^(?:{BEGIN} \d+|{END} \d+|STAGE .*|CASE .*|exit=.*)$", re.M)


def main() -> None:
    tool, logs = sys.argv[1], sys.argv[2:]
    first: dict[str, str] = {}
    for log in logs:
        text = Path(log).read_text(errors="replace")
        print(f"== {log}: {len(text.splitlines())} lines")
        cuts = [(m.start(), m.group(0)) for m in MARKER.finditer(text)]
        for (start, marker), (end, _) in zip([(0, "(start)")] + cuts, cuts + [(len(text), "")]):
            segment = text[start:end]
            reports = parse_log(segment, tool)
            counts = Counter(r.signature for r in reports)
            if counts or not marker.startswith(("STAGE", END)):
                print(marker[:200] + "".join(f"\n  {n:6d}  {s}" for s, n in counts.most_common()))
            for r in reports:
                if r.signature not in first:
                    at = segment.find(r.text.splitlines()[0])
                    first[r.signature] = "\n".join(segment[at:].splitlines()[:60]) if at >= 0 else r.text
    for sig, text in first.items():
        print(f"\n#### first report of {sig}\n{text}")


if __name__ == "__main__":
    main()
