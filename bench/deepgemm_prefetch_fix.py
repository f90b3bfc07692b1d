#!/usr/bin/env python3
"""The fix suggested in docs/bug-reports/vllm-0.33.0-deepgemm-sm90-paged-logits-zero-length-request.md, applied to a
vendored DeepGEMM's SM90 paged MQA logits kernel: the TMA warp prefetches the Q of the task the scheduler hands out
next (as vLLM 0.28.0-0.29.0 shipped it) instead of request q + 1. Edits the header in place under DEEP_GEMM_INCLUDE
(.../deep_gemm/include/deep_gemm); run the bug's kernel script before and after (with a fresh DG_JIT_CACHE_DIR).

  python bench/deepgemm_prefetch_fix.py /tmp/vllm-0.33.0/src/vllm/third_party/deep_gemm/include/deep_gemm
"""

import sys
from pathlib import Path

AHEAD = """            // Prefetch next Q when current Q changes
            bool prefetch_q = (q_idx != next_q_idx and scheduler.exist_q_atom_idx(next_q_idx + 1));
            q_idx = next_q_idx;
            kv_idx = next_kv_idx;
            num_kv = next_num_kv;

            // Wait Q consumer release and issue TMA Q
            if (prefetch_q) {
                CUTE_TIE_DECL(get_q_pipeline(q_iter_idx ++), q_stage_idx, q_phase);
                empty_q_barriers[q_stage_idx]->wait(q_phase ^ 1);
                issue_tma_q(q_stage_idx, q_idx + 1);
            }
"""
NEXT_TASK = """            q_idx = next_q_idx;
            kv_idx = next_kv_idx;
            num_kv = next_num_kv;
"""
FETCH = """            // Fetch next task
            fetched_next_task = scheduler.fetch_next_task(next_q_idx, next_kv_idx, next_num_kv);
        }
"""
FETCH_AND_PREFETCH = """            // Fetch next task, and prefetch its Q where it starts another request (the scheduler may skip
            // requests without KV, so q_idx + 1 is not necessarily the next Q the math warp-groups consume)
            fetched_next_task = scheduler.fetch_next_task(next_q_idx, next_kv_idx, next_num_kv);
            if (fetched_next_task and q_idx != next_q_idx) {
                CUTE_TIE_DECL(get_q_pipeline(q_iter_idx ++), q_stage_idx, q_phase);
                empty_q_barriers[q_stage_idx]->wait(q_phase ^ 1);
                issue_tma_q(q_stage_idx, next_q_idx);
            }
        }
"""


def main(include: str) -> int:
    path = Path(include) / "impls" / "sm90_fp8_paged_mqa_logits.cuh"
    text = path.read_text()
    if text.count(AHEAD) != 1 or text.count(FETCH) != 1:
        print(f"{path}: not the q + 1 prefetch this patch replaces (already patched, or another release)")
        return 2
    path.write_text(text.replace(AHEAD, NEXT_TASK).replace(FETCH, FETCH_AND_PREFETCH))
    print(f"{path}: the producer now prefetches the scheduler's next task")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
