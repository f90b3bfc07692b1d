"""Render a standalone reproducer (torch + vLLM only) from a finding.

The reproducer is for a stranger: the step's tensors as literals, the one vLLM call, the expected answer
computed by attnfuzz's oracle (as a literal), and a check that prints what is wrong and exits 1 while the
bug is present. On CPU it inlines the interpreter bounds checker (torch/triton/numpy only); an injected
mutant is inlined too, since it *is* the bug.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from fuzzer.support.interp import sanitizer as sanitizer_module
from oracles.index import expected_remap, remap_args_for
from strategies.tensors import materialize_index_inputs


def compact_list(xs: list[int]) -> str:
    """A short Python expression for a list of ints: runs become `[v] * n` and `list(range(a, b))`."""
    parts, i, lit = [], 0, []

    def flush():
        if lit:
            parts.append("[" + ", ".join(map(str, lit)) + "]")
            lit.clear()

    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[i]:
            j += 1
        if j - i >= 3:
            flush(); parts.append(f"[{xs[i]}] * {j - i + 1}"); i = j + 1; continue  # noqa: E702
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 3:
            flush(); parts.append(f"list(range({xs[i]}, {xs[j] + 1}))"); i = j + 1; continue  # noqa: E702
        lit.append(xs[i])
        i += 1
    flush()
    return " + ".join(parts) if parts else "[]"


def tensor_literal(name: str, t: torch.Tensor) -> str:
    if t.dim() == 1:
        return f"{name} = torch.tensor({compact_list(t.tolist())}, dtype=torch.int32, device=DEVICE)"
    rows = ",\n    ".join(compact_list(r) for r in t.tolist())
    return f"{name} = torch.tensor([\n    {rows},\n], dtype=torch.int32, device=DEVICE).reshape({t.shape[0]}, {t.shape[1]})"


_CHECK = '''
def check(out, valid_counts, expected, compacted):
    """Row by row against the documented remap; with compaction only the valid set matters."""
    problems = []
    out, exp = out.cpu().tolist(), expected.tolist()
    for r, (o, e) in enumerate(zip(out, exp)):
        want = sorted(x for x in e if x >= 0)
        if valid_counts is not None and int(valid_counts[r]) != len(want):
            problems.append(f"row {r}: valid count {int(valid_counts[r])}, expected {len(want)}")
        elif compacted and (sorted(o[: len(want)]) != want or any(x != -1 for x in o[len(want):])):
            problems.append(f"row {r}: valid prefix {sorted(o[: len(want)])[:8]}..., expected {want[:8]}...")
        elif not compacted and o != e:
            j = next(j for j in range(len(e)) if o[j] != e[j])
            problems.append(f"row {r}: out[{r}, {j}] = {o[j]}, expected {e[j]} (topk_indices[{r}, {j}])")
    return problems
'''


_CPU_ENV = """
# CPU: run vLLM's Triton kernels under Triton's interpreter. An empty CUDA_VISIBLE_DEVICES keeps vLLM
# from swapping Triton for a placeholder on a machine with no GPU driver.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
"""

_MAIN = """
def main():
    {install}
    problems, error = [], None
    with {collect} as oob:
        try:
{call}
        except Exception as e:  # vLLM refused the call
            error = e
    problems += [v.describe() for v in oob]
{judge}
    for p in problems:
        print("BUG:", p)
    print("vLLM", __import__("vllm").__version__, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0
"""

_JUDGE_CONTRACT = """\
    # req_id_per_token and topk_indices cover different tokens: the only right answer is a clear error.
    if error is None:
        problems.append(f"accepted req_id_per_token of {req_id_per_token.shape[0]} rows with topk_indices "
                        f"of {topk_indices.shape[0]} rows (the grid follows req_id, the output topk_indices)")"""

_JUDGE_VALUES = """\
    if error is not None:
        problems.append(f"raised {type(error).__name__}: {error}")
    else:
        problems += check(out, valid_counts, expected, compacted=%s)"""

_NO_CHECKER = """
class _NoBoundsCheck:  # native GPU: memory errors are compute-sanitizer's to see
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False
"""


def sanitizer_run_line(finding) -> str | None:
    """The command that shows a memory finding made under compute-sanitizer (None for other findings)."""
    tool = finding.observation.notes.get("sanitizer")
    if not tool or not any(v.check == "memory" for v in finding.verdicts):
        return None
    # PyTorch's caching allocator hides out-of-bounds accesses inside its pool (measured: 0 errors with it).
    return f"PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool {tool} python repro.py"


def _header(finding, about: str) -> str:
    host = finding.host
    run = sanitizer_run_line(finding)
    return (
        f'#!/usr/bin/env python3\n"""attnfuzz reproducer {finding.id}: {finding.title[:150]}\n\n'
        f"Found by attnfuzz target `{finding.target}` on vLLM {host.vllm}, {host.device} ({host.device_name})"
        + (f", with the injected bug `{finding.inject}` (inlined below)" if finding.inject else "") + ".\n"
        f"{about}\n"
        'Run:  python repro.py     (torch + vLLM only; exits 1 while the bug is present, 0 once fixed)\n'
        + (f"This is a memory error that compute-sanitizer sees; run it so:\n  {run}\n"
           "Run plainly, the script may look clean on the GPU: it prints that command.\n" if run else "")
        + '"""\n'
        + (f'print("attnfuzz: this bug shows under compute-sanitizer:  {run}")\n' if run else "")
    )


def render_index_repro(finding, target) -> str:
    case, host = finding.case, finding.host
    a = remap_args_for(case, materialize_index_inputs(case, "cpu"))
    cpu = host.device == "cpu"
    tensors = [tensor_literal("req_id_per_token", a.req_id), tensor_literal("block_table", a.block_table),
               tensor_literal("topk_indices", a.token_indices)]
    if a.idx_mapping is not None:
        tensors.append(tensor_literal("idx_mapping", a.idx_mapping))
    if a.prefill_request_id is not None:
        tensors += [tensor_literal("prefill_workspace_request_ids", a.prefill_request_id),
                    tensor_literal("prefill_workspace_starts", a.prefill_workspace_starts)]
    breaks = a.req_id.shape[0] != a.token_indices.shape[0]
    if not breaks:
        tensors.append("# expected: the documented remap of topk_indices (attnfuzz's oracle)")
        tensors.append(tensor_literal("expected", expected_remap(a).to(torch.int32)))
    install = ["SANITIZER.install()" if cpu else "pass"]
    if finding.inject:
        install.append("apply()  # the injected bug")
    header = _header(finding, f"Shrunk case: {case.summary()}")
    parts = [header, "import os\nimport sys\n", _CPU_ENV if cpu else "", "import torch\n",
             f'DEVICE = "{"cpu" if cpu else "cuda"}"\n# What attnfuzz saw:\n'
             + "\n".join(f"#   {v.check}: {v.detail}" for v in finding.verdicts) + "\n",
             "\n".join(tensors) + "\n", "" if breaks else _CHECK,
             _MAIN.format(install="\n    ".join(install), collect="SANITIZER.collect()" if cpu else "_NoBoundsCheck()",
                          call="\n".join("            " + ln for ln in target.repro_call(case).splitlines()),
                          judge=_JUDGE_CONTRACT if breaks else _JUDGE_VALUES % finding.observation.notes.get("compacted", False))]
    if finding.inject:
        from fuzzer.mutants import source

        parts.append(f"\n# ---- the injected bug ({finding.inject}) ----\n{source(finding.inject)}")
    if cpu:
        parts.append("\n# ---- support: bounds checks for Triton's interpreter (from attnfuzz; numpy/triton only) ----"
                     + _support_source(sanitizer_module))
    else:
        parts.append(_NO_CHECKER)
    parts.append('\nif __name__ == "__main__":\n    sys.exit(main())\n')
    return "\n".join(p for p in parts if p)


def write_repro(finding, target, root: Path) -> Path:
    from fuzzer.search.campaign import save_finding

    source, tensors = target.render_repro(finding)
    return save_finding(finding, source, root, tensors)


# --- whole-backend targets: tensors in tensors.safetensors beside repro.py ---------------------------------

def _support_source(module) -> str:
    """A support module's code without its docstring and __future__ import, for inlining."""
    return inspect.getsource(module).split('"""', 2)[2].replace("from __future__ import annotations\n", "")


_BACKEND_MAIN = '''
def main():
{setup}
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from {backend_module} import {backend_class} as Backend

    T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)
    # The paged cache as the layer left it (other rows poisoned with NaN), blocks BLOCK_STRIDE_ROWS rows apart.
    cache = T["kv_cache_rows"].as_strided((NUM_BLOCKS, BLOCK_SIZE, 576), (BLOCK_STRIDE_ROWS * 576, 576, 1))
    before = cache.clone()
    cfg = model_namespace(case, max_num_batched_tokens=T["topk_indices_buffer"].shape[0])
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    fields = {{f.name for f in dataclasses.fields(CommonAttentionMetadata)}}
    cam = CommonAttentionMetadata(**{{k: v for k, v in dict(
        query_start_loc=T["query_start_loc"], query_start_loc_cpu=T["query_start_loc"].cpu(),
        seq_lens=T["seq_lens"], seq_lens_cpu=T["seq_lens"].cpu(), seq_lens_cpu_upper_bound=T["seq_lens"].cpu(),
        num_computed_tokens_cpu=T["num_computed_tokens"].cpu(), num_reqs=NUM_REQS, num_actual_tokens=NUM_TOKENS,
        max_query_len=MAX_QUERY_LEN, max_seq_len=MAX_SEQ_LEN, block_table_tensor=T["block_table"],
        slot_mapping=T["slot_mapping"]).items() if k in fields}})
    problems, error = [], None
    with {collect} as oob:
        try:
            metadata = Backend.get_builder_cls()(spec, ["layer"], cfg, torch.device(DEVICE)).build(0, cam)
            impl = Backend.get_impl_cls()(HEADS, 576, SM_SCALE, 1, None, None, "auto", None, "decoder", None,
                                          indexer=SimpleNamespace(topk_indices_buffer=T["topk_indices_buffer"]),
                                          kv_lora_rank=512)
            q = T["q"]
            out, _lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
        except Exception as e:
            error = e
    problems += [v.describe() for v in oob]
    if error is not None:
        problems.append(f"raised {{type(error).__name__}}: {{error}}")
    else:
        out, expected = out.float().cpu(), T["expected_out"].float().cpu()
        out = out[: expected.shape[0]]  # rows of CUDA-graph padding tokens (if any) are dropped, as the runner does
        bad = ~torch.isfinite(out)
        if bad.any():
            t, h, _ = bad.nonzero()[0].tolist()
            problems.append(f"{{int(bad.sum())}} non-finite outputs, first token {{t}} head {{h}}; the fp32 reference is finite")
        err = ((out - expected).abs() / (ATOL + RTOL * expected.abs())).nan_to_num(0)
        if err.max() > 1:
            t, h, d = (err == err.max()).nonzero()[0].tolist()
            problems.append(f"output off by {{err.max():.2f}}x the tolerance at token {{t}} head {{h}} dim {{d}}: "
                            f"{{out[t, h, d]:.4g}} vs fp32 reference {{expected[t, h, d]:.4g}}")
        if not torch.equal(cache.view(torch.int16), before.view(torch.int16)):
            problems.append("the KV cache changed during attention")
    for p in problems:
        print("BUG:", p)
    print("vLLM", __import__("vllm").__version__, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0
'''


def render_backend_repro(finding, target, tensors: dict, constants: dict, backend_module: str,
                         backend_class: str) -> str:
    from fuzzer.targets import harness as backend_harness

    case, host = finding.case, finding.host
    cpu = host.device == "cpu"
    setup = []
    if cpu:
        setup += ["    install_corrections()  # Triton's interpreter: bf16 dot and casts (attnfuzz, inlined below)",
                  "    import vllm.utils.torch_utils", "    vllm.utils.torch_utils.PIN_MEMORY = False  # no accelerator to pin for"]
        if finding.observation.memory:
            setup.append("    SANITIZER.install()")
    if finding.inject:
        setup.append("    apply()  # the injected bug")
    header = _header(finding, f"Shrunk case: {case.summary()}; {case.heads} heads, values {case.values}.\n"
                     "Inputs in tensors.safetensors beside this file: q, the paged KV cache as written before attention,\n"
                     "the top-k buffer, the step's metadata and the fp32 reference output (attnfuzz's oracle).")
    consts = "\n".join(f"{k} = {v!r}" for k, v in constants.items())
    case_ns = (f"case = SimpleNamespace(topk_width={case.topk_width}, heads={case.heads}, "
               f"kv_cache_dtype={case.kv_cache_dtype!r}, block_size={case.block_size})")
    parts = [header, "import dataclasses\nimport os\nimport sys\nfrom types import SimpleNamespace\n",
             _CPU_ENV if cpu else "", "import torch\nfrom safetensors.torch import load_file\n",
             f'DEVICE = "{"cpu" if cpu else "cuda"}"\n' + consts + "\n" + case_ns + "\n# What attnfuzz saw:\n"
             + "\n".join(f"#   {v.check}: {v.detail}" for v in finding.verdicts) + "\n",
             "# The config vLLM's builder reads (as vLLM's unit tests build it, without a model):\n"
             + inspect.getsource(backend_harness.model_namespace).replace("KV_LORA_RANK", "512").replace("ROPE_DIM", "64")
             .replace("HEAD_SIZE", "576").replace("MAX_MODEL_LEN", str(backend_harness.MAX_MODEL_LEN)),
             _BACKEND_MAIN.format(setup="\n".join(setup) or "    pass", backend_module=backend_module,
                                  backend_class=backend_class,
                                  collect="SANITIZER.collect()" if cpu and finding.observation.memory else "_NoBoundsCheck()")]
    if finding.inject:
        from fuzzer.mutants import source

        parts.append(f"\n# ---- the injected bug ({finding.inject}) ----\n{source(finding.inject)}")
    if cpu:
        from fuzzer.support.interp import corrections

        parts.append("\n# ---- support: Triton interpreter corrections (from attnfuzz; numpy/torch/triton only) ----"
                     + _support_source(corrections))
    if cpu and finding.observation.memory:
        parts.append("\n# ---- support: bounds checks for Triton's interpreter (from attnfuzz) ----"
                     + _support_source(sanitizer_module))
    else:
        parts.append(_NO_CHECKER)
    parts.append('\nif __name__ == "__main__":\n    sys.exit(main())\n')
    return "\n".join(p for p in parts if p)
