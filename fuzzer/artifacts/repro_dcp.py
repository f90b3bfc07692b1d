"""Standalone reproducers for the DCP targets (`vllm.flashmla_sparse.dcp`, `.dcp.ranks`).

The script runs every rank of the saved step in one process, as the emulated target does: each rank's cache
as its writer left it (tensors.safetensors), vLLM's builder, `MLADCPManager` (query all-gather, LSE combine)
and `FlashMLASparseImpl.forward_mqa`, over attnfuzz's in-process DCP group (threads taking turns; inlined
with the rest of attnfuzz's set-up code, so the script needs torch and vLLM only). It compares the merged
heads with attnfuzz's fp32 oracle over the undivided context, and each rank's LSE with the oracle over that
rank's share. A finding of real ranks is reproduced with emulated ones: the script says so.
"""

from __future__ import annotations

import torch

from fuzzer.artifacts.repro_flashmla import _CAM, _CPU_SETUP, assemble

_MAIN = '''
def main():
    _load_vendored()
    runtime = sys.modules["fuzzer.support.flashmla_runtime"]
    dcp = sys.modules["fuzzer.support.dcp_group"]
{setup}
    emulated = runtime.install_standins(DEVICE)
{inject}
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend as Backend
    from vllm.v1.attention.ops.dcp import MLADCPManager
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    T = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensors.safetensors"), device=DEVICE)
    cfg = runtime.configure(runtime.vllm_runtime(DEVICE, tempfile.mkdtemp()), case,
                            max_num_batched_tokens=T["topk_indices_buffer"].shape[0])
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str="fp8_ds_mla")
{cam}    lses = {{}}

    def rank_step(r):
        """Rank r's step, as MLAAttention.forward_impl drives the MQA tokens under DCP."""
        width = T[f"kv_cache_rows.rank{{r}}"].shape[-1]
        cache = T[f"kv_cache_rows.rank{{r}}"].as_strided((NUM_BLOCKS, BLOCK_SIZE, width),
                                                         (BLOCK_STRIDE_ROWS * width, width, 1))
        with set_current_vllm_config(cfg), torch.inference_mode():
            impl = Backend.get_impl_cls()(
                HEADS, 576, runtime.SM_SCALE, 1, None, None, "fp8_ds_mla", None, "decoder", None,
                **runtime.impl_topk_kwargs(Backend.get_impl_cls(), T["topk_indices_buffer"].clone()),
                q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192,
                v_head_dim=128, kv_b_proj=None)
            manager = MLADCPManager(vllm_config=cfg, device=torch.device(DEVICE), num_heads=HEADS, query_head_dim=576,
                                    output_head_dim=512, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                                    padded_num_heads=getattr(impl, "q_pad_num_heads", None),
                                    is_lse_base_on_e=impl.lse_base_on_e, use_pcp=False) if DCP_SIZE > 1 else None
            cfg.compilation_config.static_forward_context[runtime.LAYER] = SimpleNamespace(
                prefill_backend=None, dcp_manager=manager)  # where the builder finds the layer's DCP manager
            metadata = Backend.get_builder_cls()(spec, [runtime.LAYER], cfg, torch.device(DEVICE)).build(0, cam)
            q = T["q"][:, r * HEADS:(r + 1) * HEADS].contiguous()  # this rank's heads
            if manager is None:
                return impl.forward_mqa(q, cache, metadata, None)[0]
            out, lses[r] = impl.forward_mqa(manager.query_gather(q), cache, metadata, None)
            return manager.combine(out, lses[r], seq_lens=metadata.seq_lens, query_start_loc=metadata.query_start_loc)

    problems, error = [], None
    ranks = dcp.LockstepRanks(DCP_SIZE)
    try:
        with dcp.installed_dcp_group(dcp.EmulatedDcpGroup(ranks)):
            merged = ranks.run(rank_step)
    except Exception as e:
        error = e
    if error is not None:
        problems.append(f"raised {{type(error).__name__}}: {{error}}")
    else:
        expected = T["expected_out"].float().cpu()
        out = torch.cat(merged, dim=1).float().cpu()
        bad = ~torch.isfinite(out)
        if bad.any():
            t, h, _ = bad.nonzero()[0].tolist()
            problems.append(f"{{int(bad.sum())}} non-finite outputs, first token {{t}} head {{h}} (rank {{h // HEADS}}'s "
                            f"heads); the fp32 reference is finite")
        err = ((out - expected).abs() / (ATOL + RTOL * expected.abs())).nan_to_num(0)
        if err.max() > 1:
            t, h, d = (err == err.max()).nonzero()[0].tolist()
            problems.append(f"merged output off by {{err.max():.2f}}x the tolerance at token {{t}} head {{h}} "
                            f"(rank {{h // HEADS}}'s heads) dim {{d}}: {{out[t, h, d]:.4g}} vs {{expected[t, h, d]:.4g}}")
        for r, lse in sorted(lses.items()):
            want, lse = T[f"expected_lse.rank{{r}}"].float().cpu(), lse.float().cpu()
            empty = torch.isneginf(want).all(dim=1)  # rows where rank r holds none of the selected tokens
            if empty.any() and not torch.isneginf(lse[empty]).all():
                problems.append(f"rank {{r}} holds none of some rows' selected tokens but returns LSE "
                                f"{{lse[empty].max():.4g}} there, not -inf (the merge's identity)")
                continue
            both = torch.isfinite(want)
            lerr = ((lse - want).abs() / (LSE_TOL + LSE_TOL * want.abs()))[both]
            if lerr.numel() and lerr.max() > 1:
                problems.append(f"rank {{r}}: LSE over its share off by {{lerr.max():.2f}}x the tolerance")
    print(f"DCP {{DCP_SIZE}} ranks emulated in one process, interleave {{INTERLEAVE}} | stand-ins for ops this host "
          f"lacks: {{', '.join(emulated) or 'none'}}")
    for p in problems:
        print("BUG:", p)
    print("vLLM", __import__("vllm").__version__, "-", "bug present" if problems else "no bug: fixed")
    return 1 if problems else 0
'''


def render_dcp_repro(finding, target) -> tuple[str, dict]:
    from fuzzer.artifacts.repro import _header
    from fuzzer.targets.harness import common_attn_metadata, step_tensors
    from oracles.attention_judge import attention_tolerance, judge_fp8_ds_mla_entries, reference_for
    from oracles.dcp import RANK_LSE_TOLERANCE, owner_and_local, rank_slot_mapping, undivided
    from strategies.tensors import materialize_attention_inputs

    case, dev = finding.case, finding.host.device
    cpu = dev == "cpu"
    whole = undivided(case)
    inp, slots, topk_buffer = step_tensors(whole, dev, materialize_attention_inputs(whole, dev))
    write, _ = target.writer(case)
    tensors = {}
    for r in range(case.dcp.size):  # each rank's cache as its writer left it: its own tokens only
        cache = target.cache(case, dev)
        write(inp.kv_c[slots], inp.k_pe[slots], cache, rank_slot_mapping(case, slots, r))
        width = cache.shape[-1]
        tensors[f"kv_cache_rows.rank{r}"] = cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1))
    # The oracle reads what the fp8 entries hold: the undivided slots' entries, gathered from their owners.
    cache_u = target.cache(whole, dev)
    write(inp.kv_c[slots], inp.k_pe[slots], cache_u, slots)
    slot_values, _ = judge_fp8_ds_mla_entries(whole, inp, slots, cache_u[slots // whole.block_size,
                                                                          slots % whole.block_size])
    expected = reference_for(whole, inp, dev, slot_values)[0]
    owner, _ = owner_and_local(case, inp.index.topk_indices.long().clamp(min=0))
    for r in range(case.dcp.size):
        tensors[f"expected_lse.rank{r}"] = reference_for(whole, inp, dev, slot_values, keep=owner == r)[1]
    atol, rtol = attention_tolerance(whole, inp)
    cam = common_attn_metadata(whole, inp.index, dev)
    tensors.update(q=inp.q, topk_indices_buffer=topk_buffer, query_start_loc=inp.index.query_start_loc,
                   seq_lens=inp.index.seq_lens, block_table=inp.index.block_table, slot_mapping=cam.slot_mapping,
                   num_computed_tokens=torch.tensor([r.context_len for r in case.requests], dtype=torch.int32),
                   expected_out=expected)
    constants = dict(DCP_SIZE=case.dcp.size, INTERLEAVE=case.dcp.interleave, HEADS=case.heads,
                     BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.num_blocks,
                     NUM_REQS=len(case.requests), NUM_TOKENS=case.num_tokens,
                     MAX_QUERY_LEN=max(r.query_len for r in case.requests),
                     MAX_SEQ_LEN=max(r.seq_len for r in case.requests), ATOL=atol, RTOL=rtol,
                     LSE_TOL=RANK_LSE_TOLERANCE[0])
    real = "" if finding.target.endswith(".dcp") else (
        "\nThe finding came from real ranks (one process per GPU); this script emulates them in one process.")
    header = _header(finding, f"Shrunk case: {case.summary()}; {case.heads} heads per rank, fp8_ds_mla, values "
                     f"{case.values}.\nInputs in tensors.safetensors beside this file; the expected output is attnfuzz's "
                     f"fp32 oracle over the undivided context (latent, 512 wide).{real}")
    main = _MAIN.format(cam=_CAM, setup="\n".join(_CPU_SETUP if cpu else ()),
                        inject="    apply()  # the injected bug" if finding.inject else "")
    return assemble(finding, header, cpu, constants, "dcp=SimpleNamespace(size=DCP_SIZE, interleave=INTERLEAVE)", main,
                    ("fuzzer.support.dcp_group",)), tensors
