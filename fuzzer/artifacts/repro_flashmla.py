"""Standalone reproducers for the FlashMLA targets (`vllm.flashmla_sparse`, `vllm.flashmla_sparse.layer`).

The script builds the same VllmConfig the target builds and, on the saved inputs (tensors.safetensors: q,
the cache as written, the top-k buffer, the step's metadata, the oracle's expected output, and for the layer
kv_b_proj's weight), calls what the target called: `FlashMLASparseImpl.forward_mqa`, or the MLAAttention
layer's `forward_impl`. What it needs of attnfuzz (the set-up code, the stand-ins for
compiled ops the host lacks, the interpreter's bounds checks) is inlined at the end as source text and
loaded under attnfuzz's module names, so the script needs torch and vLLM only.
"""

from __future__ import annotations

import inspect

import torch

_VENDORED_CPU = ("fuzzer.support.interp.corrections", "fuzzer.support.standins.cpu_shims")
_VENDORED = ("fuzzer.support.interp.sanitizer", "fuzzer.support.standins.cache_ops", "fuzzer.support.standins.flashmla_ops",
             "fuzzer.support.standins.flash_attn_ops", "fuzzer.support.flashmla_runtime")

_MAIN = '''
def main():
    _load_vendored()
    runtime = sys.modules["fuzzer.support.flashmla_runtime"]
{setup}
    emulated = tuple(dict.fromkeys(runtime.install_standins(DEVICE) + runtime.install_layer_standins(DEVICE)))
{inject}
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend as Backend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)
    cfg = runtime.configure(runtime.vllm_runtime(DEVICE, tempfile.mkdtemp()), case,
                            max_num_batched_tokens=T["topk_indices_buffer"].shape[0])
    # The paged cache as the layer left it before attention (other rows poisoned), blocks BLOCK_STRIDE_ROWS apart.
    width = T["kv_cache_rows"].shape[-1]
    cache = T["kv_cache_rows"].as_strided((NUM_BLOCKS, BLOCK_SIZE, width), (BLOCK_STRIDE_ROWS * width, width, 1))
    before = cache.clone()
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str=case.kv_cache_dtype)
{cam}    problems, error, route, overruns = [], None, {{}}, []
    with {collect} as oob:
        try:
            with set_current_vllm_config(cfg), torch.inference_mode():
{call}
        except Exception as e:
            error = e
    problems += [v.describe() for v in oob] + overruns
    if error is not None:
        problems.append(f"raised {{type(error).__name__}}: {{error}}")
    else:
        expected = T["expected_out"].float().cpu()
        out = out[: expected.shape[0]]  # rows of CUDA-graph padding tokens (if any) are dropped, as the runner does
        if out.numel() != expected.numel():
            problems.append(f"output has shape {{tuple(out.shape)}}; expected {{tuple(expected.shape)}} (the heads of this rank)")
            out = expected  # nothing more to compare
        out = out.float().cpu().view(expected.shape)
        bad = ~torch.isfinite(out)
        if bad.any():
            t, h, _ = bad.nonzero()[0].tolist()
            problems.append(f"{{int(bad.sum())}} non-finite outputs, first token {{t}} head {{h}}; the fp32 reference is finite")
        err = ((out - expected).abs() / (ATOL + RTOL * expected.abs())).nan_to_num(0)
        if err.max() > 1:
            t, h, d = (err == err.max()).nonzero()[0].tolist()
            problems.append(f"output off by {{err.max():.2f}}x the tolerance at token {{t}} head {{h}} dim {{d}}: "
                            f"{{out[t, h, d]:.4g}} vs fp32 reference {{expected[t, h, d]:.4g}}")
        if not torch.equal(cache.view(torch.uint8), before.view(torch.uint8)):
            problems.append("the KV cache changed during attention")
    print("routes:", route, "| stand-ins for ops this host lacks:", ", ".join(emulated) or "none")
    for p in problems:
        print("BUG:", p)
    print("vLLM", __import__("vllm").__version__, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0
'''

# vLLM's CommonAttentionMetadata from the saved step (only the fields this release declares).
_CAM = """\
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    cam = CommonAttentionMetadata(**{k: v for k, v in dict(
        query_start_loc=T["query_start_loc"], query_start_loc_cpu=T["query_start_loc"].cpu(),
        seq_lens=T["seq_lens"], seq_lens_cpu=T["seq_lens"].cpu(), seq_lens_cpu_upper_bound=T["seq_lens"].cpu(),
        num_computed_tokens_cpu=T["num_computed_tokens"].cpu(), num_reqs=NUM_REQS, num_actual_tokens=NUM_TOKENS,
        max_query_len=MAX_QUERY_LEN, max_seq_len=MAX_SEQ_LEN, block_table_tensor=T["block_table"],
        slot_mapping=T["slot_mapping"]).items() if k in fields})
"""

_LAYER_CALL = """\
                layer = runtime.mla_layer(cfg, case.heads, T["kv_b_weight"], T["topk_indices_buffer"], DEVICE)
                metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
                runtime.record_routes(layer.impl, route)
                check_overrun = runtime.guard_index_group(layer.impl)
                out = torch.full((NUM_TOKENS, case.heads * 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                # Decode tokens go to forward_mqa, short prefills to dense MHA: vLLM's own split.
                layer.forward_impl(T["q"], T["kv_c_normed"], T["k_pe"], cache, metadata, out)
                overruns = check_overrun(route.get("mqa_tokens", 0))"""

_MQA_CALL = """\
                metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
                # topk_indices_buffer= with indexer=None: the index group orders on the compute stream.
                impl = Backend.get_impl_cls()(
                    case.heads, 576, runtime.SM_SCALE, 1, None, None, case.kv_cache_dtype, None, "decoder", None,
                    **runtime.impl_topk_kwargs(Backend.get_impl_cls(), T["topk_indices_buffer"]),
                    q_lora_rank=None, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
                check_overrun = runtime.guard_index_group(impl)
                q = T["q"]  # (ql_nope | q_pe), as the layer hands it to forward_mqa
                out, _lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, None)
                overruns = check_overrun(NUM_TOKENS)"""

_LOADER = '''
def _load_vendored():
    """attnfuzz's support modules, inlined below as source text, importable under their own names."""
    import types

    for name, source in VENDORED.items():
        parts = name.split(".")
        for i in range(1, len(parts)):  # the parent packages
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i]))).__path__ = []
        module = types.ModuleType(name)
        module.__file__ = f"<attnfuzz {name}>"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), vars(module))
'''


def render_flashmla_repro(finding, target, layer: bool) -> tuple[str, dict]:
    from fuzzer.artifacts.repro import _NO_CHECKER, _header
    from fuzzer.targets.harness import common_attn_metadata, step_tensors, with_padded_tokens
    from oracles.attention_judge import (attention_tolerance, judge_fp8_ds_mla_entries, layer_reference_for,
                                         layer_tolerance, reference_for)
    from strategies.tensors import materialize_attention_inputs, materialize_layer_inputs

    case, dev = finding.case, finding.host.device  # the values the finding ran with are drawn on its device
    cpu = dev == "cpu"
    inputs = materialize_layer_inputs(case, dev) if layer else None
    inp, slots, topk_buffer = step_tensors(case, dev, inputs.attention if layer else materialize_attention_inputs(case, dev))
    cache = target.cache(case, dev)
    write, _ = target.writer(case)
    write(inp.kv_c[slots], inp.k_pe[slots], cache, slots)
    new = [inp.slot_of[r][req.context_len:] for r, req in enumerate(case.requests)]
    new_slots = (torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)).to(dev)
    obs = finding.observation
    slot_values = None
    if case.kv_cache_dtype == "fp8_ds_mla":
        entries = cache[slots // case.block_size, slots % case.block_size]
        slot_values, _ = judge_fp8_ds_mla_entries(case, inp, slots, entries)
    if layer:
        mha_tokens = int(obs.notes.get("route", {}).get("mha_tokens", 0))
        expected, _ = layer_reference_for(case, inputs, dev, slot_values, mha_tokens)
        atol, rtol = layer_tolerance(case, inputs)
    else:
        expected = reference_for(case, inp, dev, slot_values)[0]
        atol, rtol = attention_tolerance(case, inp)
    cam = common_attn_metadata(case, inp.index, dev)
    width = cache.shape[-1]
    tensors = dict(q=with_padded_tokens(case, inputs.q if layer else inp.q),
                   kv_cache_rows=cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1)),
                   topk_indices_buffer=topk_buffer, kv_c_normed=with_padded_tokens(case, inp.kv_c[new_slots]),
                   k_pe=with_padded_tokens(case, inp.k_pe[new_slots]).unsqueeze(1),
                   query_start_loc=inp.index.query_start_loc, seq_lens=inp.index.seq_lens,
                   block_table=inp.index.block_table, slot_mapping=cam.slot_mapping,
                   num_computed_tokens=torch.tensor([r.context_len for r in case.requests], dtype=torch.int32),
                   expected_out=expected)
    if layer:
        tensors["kv_b_weight"] = inputs.kv_b_weight
    constants = dict(BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.num_blocks,
                     NUM_REQS=len(case.requests), NUM_TOKENS=case.num_actual_tokens,  # CUDA-graph padding included
                     MAX_QUERY_LEN=max(r.query_len for r in case.requests),
                     MAX_SEQ_LEN=max(r.seq_len for r in case.requests), ATOL=atol, RTOL=rtol)
    # On a CPU every reproducer runs the interpreter under attnfuzz's checker, memory finding or not: besides the
    # bounds checks it broadcasts the 0-d masks the bare interpreter rejects ("mask has unsupported dtype", Trap 4,
    # hit by the remap kernel on FlashMLA's fp8 separate path).
    memory = cpu
    setup = list(_CPU_SETUP) if cpu else []
    if cpu:
        setup.append("    SANITIZER.install()  # bounds checks on every interpreted Triton load/store")
    header = _header(finding, f"Shrunk case: {case.summary()}; {case.heads} heads, kv_cache_dtype {case.kv_cache_dtype}, "
                     f"values {case.values}.\nInputs in tensors.safetensors beside this file; the expected output is "
                     + ("attnfuzz's fp32 oracle (after W_UV)." if layer else "attnfuzz's fp32 oracle (latent, 512 wide)."))
    main = _MAIN.format(cam=_CAM, setup="\n".join(setup), inject="    apply()  # the injected bug" if finding.inject else "",
                        call=_LAYER_CALL if layer else _MQA_CALL,
                        collect="SANITIZER.collect()" if cpu and memory else "_NoBoundsCheck()")
    lazy_sanitizer = ("\n\ndef _sanitizer():\n    return sys.modules['fuzzer.support.interp.sanitizer'].SANITIZER\n\n\n"
                      "class _Lazy:\n    def __getattr__(self, name):\n        return getattr(_sanitizer(), name)\n\n\n"
                      "SANITIZER = _Lazy()\n")
    return assemble(finding, header, cpu, constants, "dcp=SimpleNamespace(size=1, interleave=1)", main, (),
                    before_loader=() if cpu and memory else (_NO_CHECKER,),
                    after=(lazy_sanitizer,) if cpu and memory else ()), tensors


# Set-up a CPU reproducer makes before it calls vLLM.
_CPU_SETUP = ("    sys.modules['fuzzer.support.interp.corrections'].install_corrections()  # Triton interpreter: bf16 dot, casts",
              "    sys.modules['fuzzer.support.standins.cpu_shims'].install_cpu_shims()  # no accelerator: no pinned memory",
              "    runtime.cpu_shims()  # no streams on a CPU")


def assemble(finding, header: str, cpu: bool, constants: dict, case_dcp: str, main: str, extra_modules: tuple,
             before_loader: tuple = (), after: tuple = ()) -> str:
    """A whole reproducer: its docstring, imports, the step's constants, the case fields vLLM's config reads,
    what attnfuzz saw, `main`, the injected bug's source, and attnfuzz's support modules inlined verbatim."""
    from fuzzer.artifacts.repro import _CPU_ENV

    case = finding.case
    modules = (*(_VENDORED_CPU if cpu else ()), *_VENDORED, *extra_modules)
    vendored = "\n".join(f'    "{m}": r\'\'\'{_source(m)}\'\'\',' for m in modules)
    parts = [header, "import dataclasses\nimport os\nimport sys\nimport tempfile\nfrom types import SimpleNamespace\n",
             _CPU_ENV if cpu else "", "import torch\nfrom safetensors.torch import load_file\n",
             f'DEVICE = "{"cpu" if cpu else "cuda"}"\n' + "\n".join(f"{k} = {v!r}" for k, v in constants.items())
             + f"\ncase = SimpleNamespace(topk_width={case.topk_width}, heads={case.heads}, "
               f"kv_cache_dtype={case.kv_cache_dtype!r}, block_size={case.block_size},\n"
               f"                       {case_dcp})\n# What attnfuzz saw:\n"
             + "\n".join(f"#   {v.check}: {v.detail}" for v in finding.verdicts) + "\n", main]
    if finding.inject:
        from fuzzer.mutants import source

        parts.append(f"\n# ---- the injected bug ({finding.inject}) ----\n{source(finding.inject)}")
    parts += [*before_loader, _LOADER,
              "\n# ---- support: attnfuzz's set-up code and stand-ins, verbatim ----\nVENDORED = {\n" + vendored + "\n}\n",
              *after, '\nif __name__ == "__main__":\n    sys.exit(main())\n']
    return "\n".join(p for p in parts if p)


def _source(module_name: str) -> str:
    import importlib

    return inspect.getsource(importlib.import_module(module_name))
