"""`attnfuzz report DIR`: DIR/report.md and DIR/report.html from a campaign directory (`run --out DIR`)."""

from __future__ import annotations

from pathlib import Path

from fuzzer.artifacts.campaign_report import render
from fuzzer.errors import ExitCode


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render DIR/report.md and DIR/report.html from a campaign directory "
                                      "(`run --out DIR`)")
    p.add_argument("dir", type=Path)


def main(args, device: str) -> int:
    md, page = render(args.dir)  # a RecordError names the file and field: exit 2 (fuzzer/cli.py)
    print(f"{md}\n{page}")
    return ExitCode.CLEAN
