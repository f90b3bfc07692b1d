"""The target registry: name -> class. Add a target: one file here, one line below."""

from __future__ import annotations

from fuzzer.targets.base import Target
from fuzzer.targets.dcp_filter import DcpFilter
from fuzzer.targets.dsv4_flashmla import Dsv4FlashMLA
from fuzzer.targets.dsv41_flashmla import Dsv41FlashMLA
from fuzzer.targets.flashattn_layer import FlashAttnMLASparseLayer
from fuzzer.targets.flashattn_sparse import FlashAttnMLASparse
from fuzzer.targets.flashinfer_sparse_sm90 import FlashInferMLASparseSM90
from fuzzer.targets.flashmla_dcp import FlashMLASparseDcp
from fuzzer.targets.flashmla_dcp_ranks import FlashMLASparseDcpRanks
from fuzzer.targets.flashmla_layer import FlashMLASparseLayer
from fuzzer.targets.flashmla_layer_dcp import FlashMLASparseLayerDcp
from fuzzer.targets.flashmla_layer_pcp import FlashMLASparseLayerPcp
from fuzzer.targets.flashmla_sparse import FlashMLASparse
from fuzzer.targets.index_remap import IndexRemap
from fuzzer.targets.selftest import SelftestFault
from fuzzer.targets.sparse_mla_all import SparseMLAAll
from fuzzer.targets.triton_sparse import TritonSparse

TARGETS: dict[str, type[Target]] = {
    IndexRemap.name: IndexRemap,
    DcpFilter.name: DcpFilter,
    TritonSparse.name: TritonSparse,
    FlashMLASparse.name: FlashMLASparse,
    FlashMLASparseLayer.name: FlashMLASparseLayer,
    FlashMLASparseDcp.name: FlashMLASparseDcp,
    FlashMLASparseDcpRanks.name: FlashMLASparseDcpRanks,
    FlashMLASparseLayerDcp.name: FlashMLASparseLayerDcp,
    FlashMLASparseLayerPcp.name: FlashMLASparseLayerPcp,
    FlashAttnMLASparse.name: FlashAttnMLASparse,
    FlashAttnMLASparseLayer.name: FlashAttnMLASparseLayer,
    FlashInferMLASparseSM90.name: FlashInferMLASparseSM90,
    SparseMLAAll.name: SparseMLAAll,
    Dsv4FlashMLA.name: Dsv4FlashMLA,
    Dsv41FlashMLA.name: Dsv41FlashMLA,
    SelftestFault.name: SelftestFault,  # harness self-test, not vLLM
}


def get_target(name: str) -> type[Target]:
    if name not in TARGETS:
        raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]
