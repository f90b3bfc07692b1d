"""Building vLLM's sparse-MLA objects without a model, the way vLLM's own unit tests do
(../shared/docs/vllm-sparse-mla.md section 4), for any release 0.23-0.33.

The config passed to builders is `fuzzer.support.builder_config.model_namespace` (or, for the FlashMLA
targets, a real VllmConfig: `fuzzer.support.vllm_setup`); the builder, metadata, impl and kernels are
vLLM's own.
"""

from __future__ import annotations


import torch

from fuzzer.support.attn_metadata import attn_metadata
from fuzzer.support.cudagraphs import FullGraph, RunnerBuffers
from fuzzer.support.vllm_setup import has_cache_op
from fuzzer.support.sparse_mla_steps import TOPK_POISON
from fuzzer.support.standins.cache_ops import concat_and_cache_mla
from strategies.tensors import HEAD_SIZE, materialize_attention_inputs


def new_token_slots(case) -> torch.Tensor:
    """int64 [num_actual_tokens]: the cache slot of each new token (the layer writes them this step); -1 for a
    CUDA-graph padding token (the runner gives it none)."""
    slots = []
    for r, req in enumerate(case.requests):
        row = case.block_table[case.table_row(r)]
        for pos in range(req.context_len, req.seq_len):
            slots.append(row[pos // case.block_size] * case.block_size + pos % case.block_size)
    return torch.tensor(slots + [-1] * case.padded_tokens, dtype=torch.int64)


def common_attn_metadata(case, index, device):
    """vLLM's CommonAttentionMetadata for the case (`attn_metadata`: the fields the installed release declares)."""
    return attn_metadata(index.query_start_loc.to(device), index.seq_lens.to(device),
                         torch.tensor([r.context_len for r in case.requests]), index.block_table.to(device),
                         new_token_slots(case).to(device), case.num_actual_tokens,
                         max((r.query_len for r in case.requests), default=0),
                         max((r.seq_len for r in case.requests), default=0))


class DecodeGraphs:
    """A full-graph engine (Case.cudagraph "full"): the runner's persistent inputs, which every step's metadata
    views, and one captured decode forward per (tokens, query_len) the trace replays, captured at start-up
    from dummy batches, largest first, as vLLM's runner captures its sizes."""

    def __init__(self, case, device, max_model_len: int):
        steps = case.steps
        sizes = {(s.num_actual_tokens, max(r.query_len for r in s.requests)) for s in steps if s.replays_graph}
        self.sizes = sorted(sizes, reverse=True)
        self.device, self.max_model_len = device, max_model_len
        max_reqs = max([len(s.requests) for s in steps] + [t // q for t, q in self.sizes])
        max_tokens = max([s.num_actual_tokens for s in steps] + [t for t, _ in self.sizes])
        self.buffers = RunnerBuffers(max_reqs, max_tokens, len(case.block_table[0]), device)
        self.graphs: dict[tuple[int, int], tuple[FullGraph, torch.Tensor]] = {}

    def stage(self, step, index):
        """The step's CommonAttentionMetadata, its inputs copied into the runner's buffers."""
        d = self.device
        return self.buffers.stage(
            index.query_start_loc.to(d), index.seq_lens.to(d), index.block_table.to(d), new_token_slots(step).to(d),
            torch.tensor([r.context_len for r in step.requests], dtype=torch.int32), step.num_actual_tokens,
            max((r.query_len for r in step.requests), default=0), max((r.seq_len for r in step.requests), default=0))

    def capture(self, builder, forward, q_shape, q_dtype, topk_buffer) -> None:
        """Capture `forward(q, metadata) -> {name: tensor}` for every size, on a static q per graph. The
        indexer's rows for a dummy batch are -1 while capturing; the buffer is poisoned again after."""
        before = topk_buffer.clone()
        for tokens, query_len in self.sizes:
            def build(tokens=tokens, query_len=query_len):
                return builder.build_for_cudagraph_capture(self.buffers.stage_capture(tokens, query_len, self.max_model_len))

            static_q = torch.zeros((tokens, *q_shape), dtype=q_dtype, device=self.device)
            topk_buffer[:tokens] = -1
            graph = FullGraph(lambda md, q=static_q: forward(q, md), build, self.device)
            self.graphs[(tokens, query_len)] = (graph, static_q)
        topk_buffer.copy_(before)

    def replay(self, step, q) -> dict[str, torch.Tensor]:
        """The step's forward replayed from its graph, on `q` copied into the graph's static input."""
        graph, static_q = self.graphs[(step.num_actual_tokens, max(r.query_len for r in step.requests))]
        static_q.copy_(q)
        return graph.replay()

    @property
    def emulated(self) -> bool:
        return any(g.emulated for g, _ in self.graphs.values())


def paged_cache(case, device, dtype=torch.bfloat16, width: int = HEAD_SIZE, poison=float("nan"), guards=None,
                name: str = "kv_cache") -> torch.Tensor:
    """[num_blocks, block_size, width], blocks `block_stride_rows` rows apart (other layers' pages in
    between), every row poisoned so that a read of a slot no request owns shows up; inside guard regions."""
    rows, blocks = case.stride_rows, case.pool_blocks  # a trace's steps share one cache
    if guards is not None:
        storage = guards.empty(name, blocks * rows * width, dtype, device).view(-1, width)
        storage.fill_(poison)
    else:
        storage = torch.full((blocks * rows, width), poison, dtype=dtype, device=device)
    return storage.as_strided((blocks, case.block_size, width), (rows * width, width, 1))


def cache_writer(device: str):
    """vLLM's compiled `concat_and_cache_mla` where this host has it and the tensors are on its GPU, else
    attnfuzz's stand-in (a CPU run on a GPU host with the compiled ops: the CUDA op cannot take CPU tensors)."""
    if device != "cpu" and has_cache_op("concat_and_cache_mla"):
        op = torch.ops._C_cache_ops.concat_and_cache_mla
        return (lambda kv_c, k_pe, cache, slots, dtype, scale: op(kv_c, k_pe, cache, slots, dtype, scale)), None
    return concat_and_cache_mla, "concat_and_cache_mla"


def step_tensors(case, device, inputs=None, guards=None):
    """(attention inputs, the physical slots the step's requests hold, the indexer's top-k buffer) on
    `device`. The buffer has spare rows, poisoned, as the indexer's persistent buffer has."""

    inp = inputs if inputs is not None else materialize_attention_inputs(case, device)
    topk_buffer = topk_buffer_for(case, device, guards)
    fill_topk(topk_buffer, case, inp.index)
    return inp, step_slots(inp, device), topk_buffer


def step_slots(inp, device) -> torch.Tensor:
    """Every physical slot the step's requests hold (context and new tokens), unique, on `device`."""
    return (torch.unique(torch.cat(inp.slot_of)) if inp.slot_of else torch.zeros(0, dtype=torch.int64)).to(device)


def max_batched_tokens(case) -> int:
    """The engine's max_num_batched_tokens, the rows of the indexer's persistent top-k buffer: the largest step of
    the trace's tokens, and spare ones."""
    return max(s.num_actual_tokens for s in case.steps) + 8


def topk_buffer_for(case, device, guards=None) -> torch.Tensor:
    """The indexer's persistent top-k buffer, poisoned: `max_batched_tokens` rows."""
    shape = (max_batched_tokens(case), case.topk_width)
    if guards is not None:
        topk_buffer = guards.empty("topk_indices_buffer", shape[0] * shape[1], torch.int32, device).view(shape)
        return topk_buffer.fill_(TOPK_POISON)
    return torch.full(shape, TOPK_POISON, dtype=torch.int32, device=device)


def fill_topk(topk_buffer, case, index) -> None:
    """What the indexer writes for one step: its tokens' rows, -1 for padding tokens (no request); rows past
    them keep what earlier steps left there, as in vLLM's persistent buffer."""
    topk_buffer[: case.num_tokens] = index.topk_indices
    topk_buffer[case.num_tokens : case.num_actual_tokens] = -1


def with_padded_tokens(case, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (one per token of the step) and a row for each CUDA-graph padding token after them: the model
    runs on padding tokens too, so they carry values (drawn from the case's seed) that nothing may judge."""
    if not case.padded_tokens:
        return rows
    gen = torch.Generator().manual_seed(case.seed + 7919)
    pad = torch.randn((case.padded_tokens, *rows.shape[1:]), generator=gen).to(rows.dtype).to(rows.device)
    return torch.cat([rows, pad])




def note_guards_and_cache(obs, guards, cache, before: list) -> None:
    """What a whole-backend observation notes after the call: guard regions something wrote, and the cache
    rows the call changed (`before`: the cache as written before it, if the call got that far)."""
    if guard := guards.check():
        obs.notes["guard"] = guard
    changed = (cache.view(torch.uint8) != before[0].view(torch.uint8)).any(dim=-1).nonzero() if before else []
    if len(changed):
        obs.notes["cache_changed"] = f"{len(changed)} rows, first block {int(changed[0][0])} offset {int(changed[0][1])}"

# -- reproducers: what the whole-backend targets hand `fuzzer.artifacts.repro` -----------------------------

def repro_step(case, index, cache, topk_buffer, device) -> dict:
    """The tensors of a step every whole-backend reproducer loads: the paged cache as rows, blocks
    BLOCK_STRIDE_ROWS rows apart (none: the target saves its own), the top-k buffer and the inputs of
    CommonAttentionMetadata (`fuzzer.support.attn_metadata`)."""
    tensors = dict(topk_indices_buffer=topk_buffer, query_start_loc=index.query_start_loc, seq_lens=index.seq_lens,
                   block_table=index.block_table, slot_mapping=common_attn_metadata(case, index, device).slot_mapping,
                   num_computed_tokens=torch.tensor([r.context_len for r in case.requests], dtype=torch.int32))
    if cache is not None:
        width = cache.shape[-1]
        tensors["kv_cache_rows"] = cache.as_strided((case.num_blocks * case.stride_rows, width), (width, 1))
    return tensors


def repro_constants(case) -> dict:
    """The step's sizes a whole-backend reproducer names."""
    return dict(BLOCK_SIZE=case.block_size, BLOCK_STRIDE_ROWS=case.stride_rows, NUM_BLOCKS=case.num_blocks,
                NUM_REQS=len(case.requests), NUM_TOKENS=case.num_actual_tokens,  # CUDA-graph padding included
                MAX_QUERY_LEN=max(r.query_len for r in case.requests), MAX_SEQ_LEN=max(r.seq_len for r in case.requests))


def index_trace_step(observed: list, obs, step, inp, index_written: torch.Tensor, emulated: tuple,
                     shims: tuple) -> bool:
    """The bookkeeping after each step of an indexer trace (`vllm.indexer`, `vllm.dsv32.attention*`): the step's
    observation gets what was emulated, the shims and the step's padding tokens and joins `observed`; the index
    cache slots the engine now holds keys for (the step's context, its new tokens') are marked in `index_written`.
    Returns True where the trace stops at this step (an error, or a memory violation)."""
    obs.emulated = emulated
    obs.notes["shims"] = shims
    if step.padded_tokens:
        obs.notes["padded_tokens"] = step.padded_tokens
    observed.append(obs)
    index_written[inp.context_slots] = True
    index_written[inp.slots[inp.slots >= 0]] = True
    return bool(obs.error_type or obs.memory)


def trace_observation(observed: list):
    """A trace's observation: its last step's, carrying the earlier steps' (`steps`) and every step's paths."""
    last = observed[-1]
    last.steps = observed[:-1]
    if last.steps:
        last.notes["paths"] = sorted({p for o in observed for p in o.notes.get("paths", ())})
    return last
