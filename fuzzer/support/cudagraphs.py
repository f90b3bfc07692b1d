"""Full CUDA graphs of a backend's decode forward, captured and replayed as vLLM's model runner does.

With a builder of UNIFORM_BATCH support (FlashMLA sparse's), vLLM's runner captures the whole forward of
uniform decode batches at start-up, one graph per size, from dummy batches (`GPUModelRunner._dummy_run`: every
request `query_len` tokens long with `seq_len` = `query_len`, block-table rows of the null block, slots -1)
whose metadata comes from `builder.build_for_cudagraph_capture`. Later steps of that size still build their
metadata (`builder.build`), but the forward is a replay: the kernels read the tensors captured, at their
addresses. A step is right only if what it built is in those tensors: the runner's persistent inputs
(`RunnerBuffers`, views of the same storage every step) and the builder's persistent buffers, written in
place. Anything rebuilt into a new tensor is invisible to the replay (bug class M).

On a CPU there are no graphs: `FullGraph` replays by calling the forward again on the capture-time metadata
object and static inputs, which read exactly the tensors a graph would (the captured ones, not those built
since); it is reported as emulated. What a kernel launch takes from the host rather than from memory (its grid,
the offsets and buffers it points at) a captured graph keeps as the capture saw it: a stand-in whose launch takes
such parameters asks `launch_parameters`, which hands a replay the capture's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

NULL_BLOCK_ID = 0  # vLLM's block 0: what the runner fills padding and dummy block-table rows with
EMULATED = "CUDA graph capture/replay (the capture-time metadata and inputs called again: no graphs on a CPU)"


class RunnerBuffers:
    """The model runner's persistent step inputs (`query_start_loc`, `seq_lens`, the block table,
    `slot_mapping`, ...), allocated once; each step's CommonAttentionMetadata views their first rows."""

    def __init__(self, max_reqs: int, max_tokens: int, table_width: int, device):
        i32 = dict(dtype=torch.int32, device=device)
        self.device = device
        self.query_start_loc = torch.zeros(max_reqs + 1, **i32)
        self.query_start_loc_cpu = torch.zeros(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_reqs, **i32)
        self.seq_lens_cpu = torch.zeros(max_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = torch.zeros(max_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(max_reqs, table_width, **i32)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    def stage(self, query_start_loc, seq_lens, block_table, slot_mapping, num_computed_tokens, num_actual_tokens: int,
              max_query_len: int, max_seq_len: int):
        """Copy one step's inputs into the buffers (in place, as the runner's `_prepare_inputs`) and return
        vLLM's CommonAttentionMetadata over them, with the fields the installed release declares."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n, t = len(seq_lens), num_actual_tokens
        self.query_start_loc[: n + 1].copy_(query_start_loc)
        self.query_start_loc_cpu[: n + 1].copy_(query_start_loc.cpu())
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens_cpu[:n].copy_(seq_lens.cpu())
        self.num_computed_tokens_cpu[:n].copy_(num_computed_tokens.cpu())
        self.block_table[:n].copy_(block_table)
        self.slot_mapping[:t].copy_(slot_mapping)
        values = dict(
            query_start_loc=self.query_start_loc[: n + 1], query_start_loc_cpu=self.query_start_loc_cpu[: n + 1],
            seq_lens=self.seq_lens[:n], seq_lens_cpu=self.seq_lens_cpu[:n],
            seq_lens_cpu_upper_bound=self.seq_lens_cpu[:n], num_computed_tokens_cpu=self.num_computed_tokens_cpu[:n],
            num_reqs=n, num_actual_tokens=t, max_query_len=max_query_len, max_seq_len=max_seq_len,
            block_table_tensor=self.block_table[:n], slot_mapping=self.slot_mapping[:t])
        names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
        return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in names})

    def stage_capture(self, num_tokens: int, query_len: int, max_model_len: int):
        """The dummy uniform decode batch the runner captures a graph of `num_tokens` tokens from."""
        n = num_tokens // query_len
        qsl = torch.arange(n + 1, dtype=torch.int32) * query_len
        return self.stage(qsl, torch.full((n,), query_len, dtype=torch.int32),
                          torch.full((n, self.block_table.shape[1]), NULL_BLOCK_ID, dtype=torch.int32),
                          torch.full((num_tokens,), -1, dtype=torch.int64), torch.zeros(n, dtype=torch.int32),
                          num_tokens, query_len, max_model_len)


_EMULATING: list = []  # (graph, "capture" | "replay", launches counted per key) of the emulated graph in progress


@contextlib.contextmanager
def _emulating(graph, mode: str):
    _EMULATING.append((graph, mode, {}))
    try:
        yield
    finally:
        _EMULATING.pop()


def launch_parameters(key, params):
    """A stand-in kernel's host-side launch parameters (`key`: the launch site; its n-th launch in one forward):
    under an emulated capture, recorded and returned; under that graph's replay, the recorded ones (a captured
    launch keeps its grid and pointers); otherwise `params` itself."""
    if not _EMULATING:
        return params
    graph, mode, counts = _EMULATING[-1]
    n = counts[key] = counts.get(key, -1) + 1
    if mode == "capture":
        graph.launches[key, n] = params
        return params
    return graph.launches.get((key, n), params)


class FullGraph:
    """One captured forward: `forward(metadata) -> {name: tensor}` over static inputs the caller refills in
    place before each `replay()`, on metadata from `build()` (the capture batch's). On a GPU a
    torch.cuda.CUDAGraph, captured after a warm-up call on a side stream, each on metadata built for it (as
    vLLM's runner warms up and captures with dummy runs of their own: what a metadata object computes lazily
    on its first call, FlashMLA's tile scheduler, is then computed inside the graph); on a CPU the capture-time
    call made again."""

    def __init__(self, forward, build, device):
        self.emulated = torch.device(device).type != "cuda"
        if self.emulated:
            self._forward = forward
            self.metadata = build()
            self.launches: dict = {}  # what stand-ins' launches took from the host at capture (launch_parameters)
            with _emulating(self, "capture"):
                self.outputs = forward(self.metadata)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(build())  # warm-up: Triton compiles, lazy buffers are allocated outside the capture
        torch.cuda.current_stream().wait_stream(side)
        self.metadata = build()  # kept alive: the graph reads its tensors
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = forward(self.metadata)

    def replay(self) -> dict[str, torch.Tensor]:
        """Run the captured forward on what the static inputs and captured tensors hold now; copies of its outputs."""
        if self.emulated:
            with _emulating(self, "replay"):
                self.outputs = self._forward(self.metadata)
        else:
            self.graph.replay()
        return {name: t.clone() for name, t in self.outputs.items() if t is not None}
