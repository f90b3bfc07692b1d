"""`attnfuzz report DIR`: DIR/report.md and DIR/report.html from a campaign directory (`run --out DIR`)."""

from __future__ import annotations

from pathlib import Path

from fuzzer.artifacts.campaign_report import render
from fuzzer.commands.outputs import check_outputs
from fuzzer.errors import ExitCode, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render DIR/report.md and DIR/report.html from a campaign directory "
                                      "(`run --out DIR`)")
    p.add_argument("dir", type=Path)


def main(args, device: str) -> int:
    if not args.dir.is_dir():
        raise UsageError(f"{args.dir}: no such directory (a campaign directory is made by `attnfuzz run --out DIR`)")
    if not (args.dir / "campaign.json").is_file():
        raise UsageError(f"{args.dir / 'campaign.json'}: no such file (a campaign directory is made by "
                         f"`attnfuzz run --out DIR`)")
    check_outputs(files={"report": args.dir / "report.md", "page": args.dir / "report.html"})
    md, page = render(args.dir)  # a RecordError names the file and field: exit 2 (fuzzer/cli.py)
    print(f"{md}\n{page}")
    return ExitCode.CLEAN
