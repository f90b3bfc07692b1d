"""vLLM's sparse-MLA backends driven step by step as its model runner drives them, without a model.

Each function is one vLLM call sequence, written once: the targets' run() calls them on the case's tensors,
and a reproducer shows the same functions (their source, copied into repro.py) on the tensors it saved.
`replay_steps` / `replay_graph_steps` are the reproducers' loops over saved steps; the calls inside them are
the ones run() makes.
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
import warnings
from types import SimpleNamespace

import torch

from fuzzer.support import cudagraphs
from fuzzer.support.flashmla_runtime import flashmla_cpu_shims, install_layer_standins, mla_layer, record_routes
from fuzzer.support.vllm_setup import (
    HEAD_SIZE,
    KV_LORA_RANK,
    LAYER,
    MAX_MODEL_LEN,
    QK_NOPE,
    ROPE_DIM,
    SM_SCALE,
    V_HEAD,
    configure,
    cpu_shims,
    define_missing_c_queries,
    guard_index_group,
    impl_topk_kwargs,
    vllm_runtime,
)
from fuzzer.support.attn_metadata import attn_metadata
from fuzzer.support.interp.corrections import CORRECTIONS, install_corrections
from fuzzer.support.standins.cpu_shims import install_cpu_shims
from fuzzer.support.vllm_calls import implemented, named_keywords, returned

TOPK_POISON = 2**30 - 1  # rows of the indexer's top-k buffer past a step's tokens: must never be read


def prepare_cpu(device: str) -> list[str]:
    """The shims a host needs before vLLM's backends are imported (they bind PIN_MEMORY by name): the C queries
    this build lacks; on a CPU Triton's interpreter corrected (its bf16 dot and float casts) and the
    accelerator-only calls (pinned memory, streams) shimmed, FlashMLA's backend module's too."""
    shims = prepare_cpu_plumbing(device)
    if device == "cpu":
        shims += flashmla_cpu_shims()
        install_corrections()
        shims += [f"interpreter correction: {c}" for c in CORRECTIONS]
    return shims


def prepare_cpu_plumbing(device: str) -> list[str]:
    """prepare_cpu but for the interpreter's corrections and FlashMLA's module: for a backend other than FlashMLA whose
    Triton kernels are all integer ones (no dot, no float cast; FLASHINFER_MLA_SPARSE_SM90's index remap, page packing
    and kv_end clamp), which the corrections do not touch."""
    shims = list(define_missing_c_queries())
    if device == "cpu":
        shims += [*install_cpu_shims(), *cpu_shims()]
    return shims


def prepare_host(load_backend, device: str, paths: tuple = ()):
    """(vLLM's backend class, the ops attnfuzz's stand-ins replace on this host, the shims installed);
    `load_backend`: the backend's loader in flashmla_runtime (flashmla_sparse_backend, flash_attn_sparse_backend),
    handed `paths` where given (flashmla_sparse_backend_for: the stand-ins of the case's path only)."""
    shims = prepare_cpu(device)
    return (*load(load_backend, device, paths), shims)


def prepare_host_for_integer_kernels(load_backend, device: str, paths: tuple = ()):
    """prepare_host without the interpreter's corrections, for a path whose Triton kernels are all integer ones
    (FLASHMLA_SPARSE's: the index remap and the DCP filter; its attention is FlashMLA's), which they do not touch."""
    shims = prepare_cpu_plumbing(device) + (list(flashmla_cpu_shims()) if device == "cpu" else [])
    return (*load(load_backend, device, paths), shims)


def load(load_backend, device: str, paths: tuple = ()):
    """(the backend class, the ops its stand-ins replace here) from `load_backend`, handed `paths` where given."""
    return load_backend(device, paths) if paths else load_backend(device)


def prepare_layer_host(load_backend, device: str, paths: tuple = ()):
    """prepare_host, and stand-ins for the compiled ops of MLAAttention's dense-MHA path this host lacks."""
    backend, emulated, shims = prepare_host(load_backend, device, paths)
    return backend, tuple(dict.fromkeys((*emulated, *install_layer_standins(device)))), shims


def step_config(device: str, heads: int, topk_width: int, kv_cache_dtype: str, block_size: int,
                max_num_batched_tokens: int, dcp_size: int = 1, dcp_interleave: int = 1):
    """vLLM's config for the engine (a DeepSeek-V3.2-shaped model, one rank of its own), the case's fields set."""
    case = SimpleNamespace(heads=heads, topk_width=topk_width, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                           dcp=SimpleNamespace(size=dcp_size, interleave=dcp_interleave))
    return configure(vllm_runtime(device, tempfile.mkdtemp()), case, max_num_batched_tokens)


def mla_spec(block_size: int, kv_cache_dtype: str):
    """The layer's KV-cache spec, as the metadata builder gets it."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                            cache_dtype_str=kv_cache_dtype)


def metadata_builder(backend, spec, cfg, device: str):
    """The backend's metadata builder for the layer (call inside set_current_vllm_config(cfg))."""
    return implemented(backend, "get_builder_cls")()(spec, [LAYER], cfg, torch.device(device))


def release_builder(builder) -> None:
    """End an engine's metadata builder: its prefill backend keeps the last prefill metadata it was handed
    (`prepare_metadata`), which holds the backend and the builder's workspaces back, a reference cycle. A server's
    builder lives as long as its process; an engine here lasts a case, and each case's would wait in that cycle for
    Python's cyclic collector. Call once the engine has run its last step."""
    backend = getattr(builder, "_prefill_backend", None)
    if backend is not None:
        backend._prefill_metadata = None


def release_layers(*layers) -> None:
    """End an engine's vLLM layers: whatever holds a bound method of its own module (a vLLM linear layer's weight
    parameter its `weight_loader`, a CustomOp its dispatched forward) makes a reference cycle of that module and what
    it holds. A server's model keeps them for the process's life; an engine here lasts a case, and each case's would
    wait in those cycles for Python's cyclic collector. Call once the engine has run its last step: the methods are
    dropped, and the layers are not to be called again."""
    for layer in layers:
        for module in layer.modules():
            for owner in (module, *module.parameters(recurse=False)):
                for name, value in list(vars(owner).items()):
                    if inspect.ismethod(value) and value.__self__ is module:
                        setattr(owner, name, None)


def sparse_mla_engine(backend, spec, cfg, heads: int, kv_cache_dtype: str, topk_indices_buffer, device: str):
    """(builder, impl) as the runner keeps them for the engine's life. topk_indices_buffer= with no indexer: the
    index group orders its conversion on the compute stream."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        builder = metadata_builder(backend, spec, cfg, device)
        impl = sparse_mla_impl(backend, heads, kv_cache_dtype, topk_indices_buffer)
    return builder, impl


def sparse_mla_impl(backend, heads: int, kv_cache_dtype: str, topk_indices_buffer):
    """The backend's impl for the layer, as MLAAttention constructs it (call inside set_current_vllm_config)."""
    impl_cls = implemented(backend, "get_impl_cls")()
    return impl_cls(
        heads, HEAD_SIZE, SM_SCALE, 1, None, None, kv_cache_dtype, None, "decoder", None,
        **named_keywords(impl_cls, impl_cls.__name__, **impl_topk_kwargs(impl_cls, topk_indices_buffer),
                         q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=QK_NOPE,
                         qk_rope_head_dim=ROPE_DIM, qk_head_dim=QK_NOPE + ROPE_DIM, v_head_dim=V_HEAD, kv_b_proj=None))


def mla_attention_engine(backend, spec, cfg, heads: int, kv_b_weight, topk_indices_buffer, device: str):
    """(builder, MLAAttention layer on the backend, its route counts) as the runner keeps them: the layer with
    kv_b_proj holding `kv_b_weight`, registered as the forward context's layer, which the builder reads."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        layer = mla_layer(cfg, heads, kv_b_weight, topk_indices_buffer, device, backend=backend)
        builder = metadata_builder(backend, spec, cfg, device)
    route: dict = {}
    record_routes(layer.impl, route)
    return builder, layer, route


def forward_mqa(impl, q, kv_cache, metadata, layer=None):
    """impl.forward_mqa on q = (ql_nope | q_pe) as MLAAttention.forward_impl hands it over (handed `layer`): split;
    with a quantized cache, that cache viewed as fp8 unless its format is a packed per-token one, and the query
    quantized by the layer's `_decode_concat_quant_fp8_op` (its q_scale) for an impl that takes a quantized query
    (`supports_quant_query_input`). Returns (out, lse)."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    q = (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])
    dtype = getattr(impl, "kv_cache_dtype", "auto")
    if layer is not None and is_quantized_kv_cache(dtype):
        if dtype not in ("fp8_ds_mla", "nvfp4_ds_mla"):
            kv_cache = kv_cache.view(current_platform.fp8_dtype())
        if getattr(impl, "supports_quant_query_input", False):
            q = layer._decode_concat_quant_fp8_op(*q, layer._q_scale)
    with uninitialized_memory_as_nan():
        forward = implemented(impl, "forward_mqa")
        out = forward(q, kv_cache, metadata, layer)
    return returned(out, 2, f"{type(impl).__name__}.forward_mqa")


@contextlib.contextmanager
def uninitialized_memory_as_nan():
    """What torch.empty hands out reads NaN (PyTorch's fill_uninitialized_memory, on with deterministic
    algorithms; warn_only: no op refuses): an output row no kernel writes is NaN on every host and allocator,
    not whatever the memory held before."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "... does not have a deterministic implementation"
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def layer_forward(layer, q, kv_c_normed, k_pe, kv_cache, metadata, output):
    """MLAAttention.forward_impl: decode tokens to forward_mqa, short prefills to dense MHA (vLLM's own
    split); writes `output` [tokens, heads * 128]."""
    with uninitialized_memory_as_nan():
        layer.forward_impl(q, kv_c_normed, k_pe, kv_cache, metadata, output)
    return output


def update_draft_metadata(builder, cam, metadata, advanced):
    """An MTP draft step's metadata as vLLM's speculator makes it: the step before's runner inputs advanced in
    place (seq_lens, slot_mapping), then the builder's update_draft_decode_metadata; a builder that cannot
    update in place is rebuilt, as the speculator falls back. Returns (cam, metadata, how)."""
    cam.seq_lens.copy_(advanced.seq_lens)
    cam.slot_mapping.copy_(advanced.slot_mapping)
    if getattr(builder, "supports_draft_decode_metadata_update", False):  # releases without draft updates lack it
        from vllm.v1.attention.backend import AttentionMetadataBuilder

        # The builder's own: AttentionMetadataBuilder's raises NotImplementedError, as a builder that cannot would.
        implemented(builder, "update_draft_decode_metadata", below=AttentionMetadataBuilder)(metadata)
        return cam, metadata, "update_draft_decode_metadata"
    return advanced, builder.build(0, advanced), "rebuilt"


# -- reproducers: the saved steps of a trace, replayed ----------------------------------------------------------

def poisoned_cache(T, num_blocks: int, block_size: int, block_stride_rows: int, fp8: bool, device: str):
    """The paged cache, blocks `block_stride_rows` rows apart (other layers' pages between), every row poisoned:
    NaN for bf16; 0xFF bytes (fp8 NaN codes, NaN scales) for fp8_ds_mla. Returns (rows, cache)."""
    width, dtype = T["s1.written_rows"].shape[-1], T["s1.written_rows"].dtype
    rows = torch.full((num_blocks * block_stride_rows, width), 255 if fp8 else float("nan"), dtype=dtype, device=device)
    cache = rows.as_strided((num_blocks, block_size, width), (block_stride_rows * width, width, 1))
    return rows, cache


def topk_buffer(rows: int, topk_width: int, device: str):
    """The indexer's persistent top-k buffer, poisoned."""
    return torch.full((rows, topk_width), TOPK_POISON, dtype=torch.int32, device=device)


def saved_step(T, k: int, rows, topk_indices_buffer, block_size: int, block_stride_rows: int):
    """Step k's tensors (T["s<k>.*"]), after what the layer and the indexer did before attention: the step's
    cache rows written as vLLM's cache writer wrote them, its tokens' top-k rows in the persistent buffer (rows
    past them keep what earlier steps left there)."""
    S = {name.split(".", 1)[1]: t for name, t in T.items() if name.startswith(f"s{k}.")}
    slots = S["written_slots"]
    rows[slots // block_size * block_stride_rows + slots % block_size] = S["written_rows"]
    n = S["topk_indices"].shape[0]
    topk_indices_buffer[:n] = S["topk_indices"]
    topk_indices_buffer[n: S["q"].shape[0]] = -1  # CUDA-graph padding tokens: no request, no top-k
    return S


def step_metadata(S, step: dict):
    return attn_metadata(S["query_start_loc"], S["seq_lens"], S["num_computed_tokens"], S["block_table"],
                         S["slot_mapping"], step["NUM_TOKENS"], step["MAX_QUERY_LEN"], step["MAX_SEQ_LEN"])


def replay_steps(builder, impl, cfg, steps: list, T, rows, cache, topk_indices_buffer, block_size: int,
                 block_stride_rows: int, device: str, found: list, layer=None):
    """The trace's steps through impl.forward_mqa (handed `layer`) on the engine's builder, one cache and one
    top-k buffer, as vLLM's runner keeps them; a step marked DRAFT runs on the step before's metadata updated in
    place, and again on metadata built for it. Returns (the last step's output, the cache before its call)."""
    from vllm.config import set_current_vllm_config

    cam = metadata = None  # the step before's (a DRAFT step's start)
    with set_current_vllm_config(cfg), torch.inference_mode():
        for k, step in enumerate(steps, start=1):
            S = saved_step(T, k, rows, topk_indices_buffer, block_size, block_stride_rows)
            before = cache.clone()
            fresh = step_metadata(S, step)
            if step.get("DRAFT"):
                cam, metadata, _ = update_draft_metadata(builder, cam, metadata, fresh)
            else:
                cam, metadata = fresh, builder.build(0, fresh)
            check_overrun = guard_index_group(impl, poison=k == 1)
            out, _lse = forward_mqa(impl, S["q"], cache, metadata, layer)
            found += [f"step {k}: {m}" for m in check_overrun(step["NUM_TOKENS"])]
            if step.get("DRAFT"):  # the bits the in-place update promises: those of metadata built for the step
                rebuilt, _lse = forward_mqa(impl, S["q"], cache, builder.build(0, fresh), layer)
                if not torch.equal(out.view(torch.uint8), rebuilt.view(torch.uint8)):
                    differ = int((out != rebuilt).any(-1).any(-1).sum())
                    found.append(f"step {k}: the MTP draft step on metadata updated in place "
                                 f"(update_draft_decode_metadata) differs from the same step on metadata built for it "
                                 f"in {differ} of {out.shape[0]} tokens")
    return out, before


def replay_layer_steps(builder, layer, route, cfg, steps: list, T, rows, cache, topk_indices_buffer, block_size: int,
                       block_stride_rows: int, device: str, found: list):
    """The trace's steps through the MLAAttention `layer` (forward_impl: decodes to forward_mqa, short prefills
    to dense MHA), on one builder, cache and top-k buffer. Returns (the last step's output, the cache before)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg), torch.inference_mode():
        for k, step in enumerate(steps, start=1):
            S = saved_step(T, k, rows, topk_indices_buffer, block_size, block_stride_rows)
            before = cache.clone()
            metadata = builder.build(0, step_metadata(S, step))
            check_overrun = guard_index_group(layer.impl, poison=k == 1)
            route.clear()
            out = torch.full((step["NUM_TOKENS"], S["q"].shape[1] * V_HEAD), float("nan"), dtype=torch.bfloat16,
                             device=device)
            layer_forward(layer, S["q"], S["kv_c_normed"], S["k_pe"], cache, metadata, out)
            found += [f"step {k}: {m}" for m in check_overrun(route.get("mqa_tokens", 0))]
    return out, before


def replay_graph_steps(builder, impl, cfg, steps: list, T, rows, cache, topk_indices_buffer, block_size: int,
                       block_stride_rows: int, graph_sizes: list, max_reqs: int, table_width: int, device: str,
                       found: list, layer=None):
    """A full-graph engine: the runner's persistent inputs (every step's metadata views them), a graph per
    uniform decode size captured before the first step from a dummy batch (null-block rows, slots -1), replayed
    for each step marked REPLAY and compared with the same step run eagerly (unless marked EAGER False: padded
    metadata that vLLM's runner makes for a FULL graph only, and that a backend's Python refuses eagerly). Returns (out, cache before, how the
    graphs ran: captured, or emulated where there are no CUDA graphs)."""
    from vllm.config import set_current_vllm_config

    runner = cudagraphs.RunnerBuffers(max_reqs, topk_indices_buffer.shape[0], table_width, device)
    heads = T["s1.q"].shape[1]
    graphs = {}
    with set_current_vllm_config(cfg), torch.inference_mode():
        for tokens, query_len in graph_sizes:
            static_q = torch.zeros((tokens, heads, HEAD_SIZE), dtype=torch.bfloat16, device=device)
            topk_indices_buffer[:tokens] = -1  # the dummy batch's indexer rows
            graphs[tokens, query_len] = static_q, cudagraphs.FullGraph(
                lambda md, q=static_q: {"out": forward_mqa(impl, q, cache, md, layer)[0]},
                lambda t=tokens, ql=query_len: builder.build_for_cudagraph_capture(
                    runner.stage_capture(t, ql, MAX_MODEL_LEN)), device)
        topk_indices_buffer.fill_(TOPK_POISON)
        for k, step in enumerate(steps, start=1):
            S = saved_step(T, k, rows, topk_indices_buffer, block_size, block_stride_rows)
            before = cache.clone()
            metadata = builder.build(0, runner.stage(S["query_start_loc"], S["seq_lens"], S["block_table"],
                                                     S["slot_mapping"], S["num_computed_tokens"], step["NUM_TOKENS"],
                                                     step["MAX_QUERY_LEN"], step["MAX_SEQ_LEN"]))
            check_overrun = guard_index_group(impl, poison=k == 1)
            if not step["REPLAY"]:
                out = forward_mqa(impl, S["q"], cache, metadata, layer)[0]
            else:  # a uniform decode step: its graph replayed, and the same step eagerly for comparison
                static_q, graph = graphs[step["NUM_TOKENS"], step["MAX_QUERY_LEN"]]
                static_q.copy_(S["q"])
                out = graph.replay()["out"]
                if not step.get("EAGER", True):  # padded metadata that the backend takes only inside its graph
                    found += [f"step {k}: {m}" for m in check_overrun(step["NUM_TOKENS"])]
                    continue
                eager = forward_mqa(impl, S["q"], cache, metadata, layer)[0]
                if not torch.equal(out.view(torch.uint8), eager.view(torch.uint8)):
                    differ = int((out.view(torch.uint8) != eager.view(torch.uint8)).any(-1).any(-1).sum())
                    found.append(f"step {k}: replayed from its CUDA graph, it differs from the step run eagerly in "
                                 f"{differ} of {out.shape[0]} tokens")
            found += [f"step {k}: {m}" for m in check_overrun(step["NUM_TOKENS"])]
    emulated = any(graph.emulated for _, graph in graphs.values())
    return out, before, cudagraphs.EMULATED if emulated else "captured and replayed"
