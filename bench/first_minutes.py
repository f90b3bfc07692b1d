#!/usr/bin/env python3
"""A newcomer's first minutes (issue 35, item 6): how long `attnfuzz list` and an argument error take, and when
README's main job (`attnfuzz run --target vllm.index_remap --max-examples 100`) prints its first line and finishes.

  .venv/bin/python bench/first_minutes.py [--seeds 1,2,3] [--repeat 3] [--out DIR] [--in-place] [--skip-run]

Every command runs as a new process, one at a time, in a fresh copy of this working tree (the files a clone would
have, tracked and untracked ones git does not ignore: no .attnfuzz/ state, no example database, no __pycache__),
through this checkout's interpreter (`python -m fuzzer.cli`, so the copy's code runs). --in-place runs in this
checkout instead (its caches and state as they are; each campaign still gets a fresh ATTNFUZZ_STATE).

  list         `attnfuzz list`, --repeat times (exit 0)
  arg-error    `attnfuzz run --target vllm.index_remap --db <a file>`, --repeat times (exit 2, before vLLM loads)
  main-job     `attnfuzz run --target vllm.index_remap --max-examples 100 --seed S` per seed: seconds to its first
               line (on stderr or stdout) and to its exit (exit 0), with the run's own figures (--json)

Prints one row per measurement (median, min, max of wall seconds) and writes OUT/first_minutes.json and
OUT/first_minutes.md. Targets (issue 35 on the 2-core CI host): list and an argument error within 5 s; the main job's
first line within 10 s and its 100 cases within 60 s, median of seeds 1-3. Other processes on the host inflate every
figure: measure on a quiet host, or compare two trees under the same load back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ("run", "--target", "vllm.index_remap", "--max-examples", "100")


def fresh_copy(dest: Path) -> Path:
    """The working tree's files as a clone would have them (plus uncommitted and untracked, not ignored, ones)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def timed(argv: list[str], cwd: Path, env: dict, timeout: float) -> dict:
    """Run `python -m fuzzer.cli ARGV`: wall seconds to its first output line and to its exit, and its exit code."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "fuzzer.cli", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first: list[float] = []
    tails: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def read(stream, name):
        for line in stream:
            if not first:
                first.append(time.monotonic() - start)
            tails[name] = (tails[name] + [line.rstrip("\n")])[-20:]

    readers = [threading.Thread(target=read, args=(proc.stdout, "stdout")),
               threading.Thread(target=read, args=(proc.stderr, "stderr"))]
    for r in readers:
        r.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    for r in readers:
        r.join()
    return {"argv": argv, "rc": rc, "first_line_s": round(first[0], 2) if first else None,
            "total_s": round(time.monotonic() - start, 2), "stderr_tail": tails["stderr"][-5:]}


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "n": len(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--repeat", type=int, default=3, help="runs of `list` and of the argument error")
    ap.add_argument("--out", type=Path, default=Path("/tmp/attnfuzz-first-minutes"))
    ap.add_argument("--in-place", action="store_true", help="run in this checkout, not in a fresh copy of it")
    ap.add_argument("--skip-run", action="store_true", help="only `list` and the argument error")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for one command before it is killed")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="attnfuzz-first-minutes-"))
    tree = ROOT if args.in_place else fresh_copy(work / "tree")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNFUZZ_", "TRITON_", "VLLM_"))}
    env.pop("OMP_NUM_THREADS", None)  # as a newcomer's shell has it: attnfuzz sets its own
    not_a_dir = work / "not-a-directory"
    not_a_dir.write_text("")
    runs: dict[str, list[dict]] = {"list": [], "arg-error": [], "main-job": []}
    for i in range(args.repeat):
        state = dict(env, ATTNFUZZ_STATE=str(work / f"state-list-{i}"))
        runs["list"].append(timed(["list"], tree, state, args.timeout))
        runs["arg-error"].append(timed([*MAIN_JOB, "--db", str(not_a_dir)], tree, state, args.timeout))
    if not args.skip_run:
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            d = work / f"seed-{seed}"
            r = timed([*MAIN_JOB, "--seed", str(seed), "--json", str(d / "summary.json"), "--repros", str(d / "repros")],
                      tree, dict(env, ATTNFUZZ_STATE=str(d / "state")), args.timeout)
            summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
            r.update(seed=seed, **{k: summary.get(k) for k in ("examples", "seconds", "startup_seconds")})
            runs["main-job"].append(r)
            print(f"seed {seed}: first line {r['first_line_s']} s, exit {r['rc']} after {r['total_s']} s "
                  f"({r.get('examples')} cases, start-up {r.get('startup_seconds')} s)", flush=True)
    expected = {"list": 0, "arg-error": 2, "main-job": 0}
    rows = [("list", "total_s", 5), ("arg-error", "total_s", 5), ("main-job", "first_line_s", 10),
            ("main-job", "total_s", 60)]
    table = []
    for name, key, target in rows:
        if not runs[name]:
            continue
        s = spread([r[key] for r in runs[name]])
        wrong = [r["rc"] for r in runs[name] if r["rc"] != expected[name]]
        table.append({"measure": f"{name} {key}", "target_s": target, **s,
                      "exit_codes_wrong": wrong})
    md = ["| measure | median s | min s | max s | runs | target s | wrong exit codes |", "|---|---|---|---|---|---|---|"]
    md += [f"| {t['measure']} | {t['median']} | {t['min']} | {t['max']} | {t['n']} | {t['target_s']} | "
           f"{', '.join(map(str, t['exit_codes_wrong'])) or '-'} |" for t in table]
    host = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "tree": "in place" if args.in_place else "fresh copy"}
    (args.out / "first_minutes.json").write_text(json.dumps({"host": host, "table": table, "runs": runs}, indent=1))
    (args.out / "first_minutes.md").write_text("\n".join(md) + f"\n\nhost: {host}\n")
    print("\n".join(md))
    print(f"host: {host}; {args.out}/first_minutes.json")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not t["exit_codes_wrong"] for t in table) else 1


if __name__ == "__main__":
    sys.exit(main())
