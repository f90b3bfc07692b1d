"""A FlashInfer plan made for more tokens serves a smaller step (class A) at FLASHINFER_MLA_SPARSE_SM90's own call site.

The seed bug's class: per-token metadata and the call it serves cover different tokens. The backend's builder's
FlashInfer plan is per-token metadata: one batch row per query token (qo_indptr, kv_indptr, the work items
FlashInfer schedules over them), kept by `_SM90State` across steps and reused while its planned lengths still bound
the step's. vLLM replans whenever the step's token count differs (`num_tokens != self._planned_num_tokens`); here
only when it grows, so the plan of a step of more tokens serves a later, smaller one: its work items cover rows past
the step's tokens, and the device clamp reads req_id_per_token past the step's rows while FlashInfer's kernel reads
query rows past q and writes output rows past the step's (the grid follows the plan, the tensors the step)."""

from fuzzer.mutants._kernel_patch import patch_method

BUG_CLASS = "A"
TARGETS = ("vllm.flashinfer_sparse_sm90", "vllm.flashinfer_sparse_sm90.layer")


def apply():
    patch_method("vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90", "_SM90State", "plan",
                 [("num_tokens != self._planned_num_tokens", "num_tokens > self._planned_num_tokens")],
                 "sm90-plan-reused-for-fewer-tokens")
