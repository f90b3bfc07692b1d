"""Which part of a saved STEP5_DSA case makes vLLM's decode route write NaN on a GPU: the case run in-process through
the `vllm.step5_dsa` target (as a campaign runs and judges it), then again with one thing changed at a time: fewer decodes (the
split count follows the row count: 128 rows take two splits, 132 rows one), power-of-two fp8 scales, and vLLM's
programmatic dependent launch (`_PDL` of the decode kernel's module) turned off. Prints the non-finite output values
of each variant.

    scripts/gpu-host.sh python3 bench/step5_nan_bisect.py bench/triage/step5-fp8-nan/case.json
"""

from __future__ import annotations

import dataclasses
import sys

from fuzzer import api  # first: prepares the process for vLLM
from fuzzer.run.worker import run_and_judge
from strategies.case import Case


def first_decodes(case: Case, n: int) -> Case:
    return dataclasses.replace(case, requests=case.requests[:n], num_decodes=n, block_table=case.block_table[:n])


def run(label: str, case: Case) -> None:
    obs, verdicts = run_and_judge(api.target("vllm.step5_dsa"), case)
    failed = [v for v in verdicts if not v.ok]
    verdict = f"{len(failed)} failed: {failed[0].detail[:90]}" if failed else "pass"
    out = obs.outputs.get("out.0")
    bad = int((~out.isfinite()).sum()) if out is not None else -1
    print(f"{label:40s} rows={len(case.requests) * case.step5.groups:4d} non-finite={bad:7d} | {verdict}", flush=True)


def main() -> None:
    case = Case.from_json(open(sys.argv[1]).read())
    run("saved case", case)
    for n in (64, 65, 66):
        run(f"first {n} decodes", first_decodes(case, n))
    run("fp8 scales pow2", dataclasses.replace(case, fp8_scale="pow2"))
    from vllm.models.step5.nvidia.ops import sparse_decode_attention as decode
    pdl, decode._PDL = decode._PDL, False
    run(f"PDL off (was {pdl})", case)
    run("PDL off, first 64 decodes", first_decodes(case, 64))


if __name__ == "__main__":
    main()
