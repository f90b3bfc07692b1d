"""The target registry: name -> class. Add a target: one file here, one line below.

A class is imported when it is first asked for (`TARGETS[name]`, `.items()`, `.values()`): a target module imports
torch, and `attnfuzz list` and `run`'s argument checks need none of them. What they read of a target (its summary,
bug classes, kv-cache dtypes, CUDA-graph modes, what it needs of the host) comes from `declared(name)`, read from
the class's source (fuzzer/targets/declared.py)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from functools import lru_cache

from fuzzer.targets import declared as declarations
from fuzzer.targets.base import Target

# name -> "module:Class"
REGISTERED: dict[str, str] = {
    "vllm.index_remap": "fuzzer.targets.index_remap:IndexRemap",
    "vllm.dcp_filter": "fuzzer.targets.dcp_filter:DcpFilter",
    "vllm.triton_sparse": "fuzzer.targets.triton_sparse:TritonSparse",
    "vllm.flashmla_sparse": "fuzzer.targets.flashmla_sparse:FlashMLASparse",
    "vllm.flashmla_sparse.nvfp4": "fuzzer.targets.flashmla_sparse_nvfp4:FlashMLASparseNvfp4",
    "vllm.flashmla_sparse.layer": "fuzzer.targets.flashmla_layer:FlashMLASparseLayer",
    "vllm.flashmla_sparse.dcp": "fuzzer.targets.flashmla_dcp:FlashMLASparseDcp",
    "vllm.flashmla_sparse.dcp.ranks": "fuzzer.targets.flashmla_dcp_ranks:FlashMLASparseDcpRanks",
    "vllm.flashmla_sparse.layer.dcp": "fuzzer.targets.flashmla_layer_dcp:FlashMLASparseLayerDcp",
    "vllm.flashmla_sparse.layer.pcp_dcp": "fuzzer.targets.flashmla_layer_pcp:FlashMLASparseLayerPcp",
    "vllm.flashattn_sparse": "fuzzer.targets.flashattn_sparse:FlashAttnMLASparse",
    "vllm.flashattn_sparse.layer": "fuzzer.targets.flashattn_layer:FlashAttnMLASparseLayer",
    "vllm.flashattn_sparse_fa4": "fuzzer.targets.flashattn_sparse_fa4:FlashAttnMLASparseFA4",
    "vllm.flashinfer_sparse_sm90": "fuzzer.targets.flashinfer_sparse_sm90:FlashInferMLASparseSM90",
    "vllm.flashinfer_sparse_sm90.layer": "fuzzer.targets.flashinfer_sparse_sm90_layer:FlashInferMLASparseSM90Layer",
    "vllm.flashinfer_sparse_sm100": "fuzzer.targets.flashinfer_sparse_blackwell:FlashInferMLASparseSM100",
    "vllm.flashinfer_sparse_sm120": "fuzzer.targets.flashinfer_sparse_blackwell:FlashInferMLASparseSM120",
    "vllm.rocm_aiter_sparse": "fuzzer.targets.rocm_aiter_sparse:RocmAiterMLASparse",
    "vllm.sparse_mla.all": "fuzzer.targets.sparse_mla_all:SparseMLAAll",
    "vllm.indexer": "fuzzer.targets.indexer:Indexer",
    "vllm.dsv32.attention": "fuzzer.targets.dsv32_attention:Dsv32Attention",
    "vllm.dsv32.attention.flashattn": "fuzzer.targets.dsv32_attention_backends:Dsv32AttentionFlashAttn",
    "vllm.dsv32.attention.flashinfer_sm90": "fuzzer.targets.dsv32_attention_backends:Dsv32AttentionFlashInferSM90",
    "vllm.dsv32.attention.dcp": "fuzzer.targets.dsv32_attention_dcp:Dsv32AttentionDcp",
    "vllm.dsv32.attention.pcp_dcp": "fuzzer.targets.dsv32_attention_pcp:Dsv32AttentionPcp",
    "vllm.dsv32.attention.shardq": "fuzzer.targets.dsv32_attention_shardq:Dsv32AttentionShardQ",
    "vllm.dsv4.flashmla": "fuzzer.targets.dsv4_flashmla:Dsv4FlashMLA",
    "vllm.dsv41.flashmla": "fuzzer.targets.dsv41_flashmla:Dsv41FlashMLA",
    "vllm.dsv41.flashmla_mega": "fuzzer.targets.dsv41_flashmla_mega:Dsv41FlashMLAMega",
    "vllm.dsv4.flashinfer": "fuzzer.targets.dsv4_flashinfer:Dsv4FlashInfer",
    "vllm.dsv41.flashinfer": "fuzzer.targets.dsv4_flashinfer:Dsv41FlashInfer",
    "vllm.dsv4.rocm": "fuzzer.targets.dsv4_rocm:Dsv4Rocm",
    "vllm.dsv41.rocm": "fuzzer.targets.dsv4_rocm:Dsv41Rocm",
    "vllm.dsv4.all": "fuzzer.targets.dsv4_all:Dsv4All",
    "vllm.dsv41.all": "fuzzer.targets.dsv4_all:Dsv41All",
    "vllm.step5_dsa": "fuzzer.targets.step5_dsa:Step5DSA",
    "selftest.fault": "fuzzer.targets.selftest:SelftestFault",  # harness self-test, not vLLM
}


class _Registry(Mapping):
    """A read-only mapping name -> class over REGISTERED that imports each class when it is first looked up."""

    def __init__(self, registered: dict[str, str]) -> None:
        self._registered = registered
        self._classes: dict[str, type[Target]] = {}

    def __getitem__(self, name: str) -> type[Target]:
        cls = self._classes.get(name)
        if cls is None:
            module, _, attr = self._registered[name].partition(":")  # KeyError: an unknown name
            cls = self._classes[name] = getattr(importlib.import_module(module), attr)
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self._registered

    def __iter__(self) -> Iterator[str]:
        return iter(self._registered)

    def __len__(self) -> int:
        return len(self._registered)

    def __repr__(self) -> str:
        return f"TARGETS({', '.join(self._registered)})"


TARGETS: Mapping[str, type[Target]] = _Registry(REGISTERED)


@lru_cache(maxsize=None)
def declared(name: str) -> declarations.Declared:
    """What target `name` declares (name, summary, bug classes, dtypes, graph modes, host needs, lineage), read
    without importing it. KeyError: an unknown name."""
    return declarations.read(REGISTERED[name])


def get_target(name: str) -> type[Target]:
    if name not in TARGETS:
        raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]
