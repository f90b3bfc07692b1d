"""Size limits of generated cases, per host: interpreted Triton on a CPU costs ~1000x a GPU launch."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Dsv4Sizes:
    """DeepSeek-V4 steps (strategies.dsv4_batches). Interpreted, vLLM's dequantizing gather costs ~40 ms a gathered
    record and its combine ~5 ms a program (256 a prefill request): a CPU step keeps its prefills' gathers short
    (small windows, few compressed entries) and puts long contexts on decodes, which gather nothing."""

    max_decodes: int
    max_prefills: int
    max_tokens: int
    max_context: int  # a decode's cached tokens
    max_prefill_context: int  # a prefill's cached tokens
    max_prefill_compressed: int  # compressed entries a prefill request gathers (seq_len // ratio)
    topk_widths: tuple[int, ...]  # index_topk
    window_sizes: tuple[int, ...]  # sliding_window (the model's is 128)
    heads: tuple[int, ...]  # per rank; vLLM pads q to 64 or 128
    max_speculative: int = 3  # MTP draft tokens


@dataclass(frozen=True)
class IndexerSizes:
    """Indexer steps (strategies.indexer_batches). Its kernels are stand-ins in torch on a CPU (no interpreted
    Triton on the hot path), so contexts reach past the widths the top-k kernels take (512, 1024, 2048) there too;
    a "tight" logits budget splits a step's prefills into chunks: 0 MB on a CPU (every request a chunk of its own,
    one query row per sub-chunk: the code paths a long prompt takes at vLLM's 512 MB), a few MB on a GPU."""

    max_decodes: int
    max_prefills: int
    max_tokens: int
    max_context: int
    topk_widths: tuple[int, ...]  # index_topk; the first is where shrinking goes
    heads: tuple[int, ...]  # index_n_heads: DeepSeek-V3.2's 64, GLM-5's 32
    tight_logits_mb: int = 0
    # Case.indexer.num_sms: the device's SMs (0) where shrinking goes, then fewer, so that a step of a dozen
    # requests already gives an SM several of them (as 132 SMs do only past ~132 segments of 256 keys)
    sms: tuple[int, ...] = (0, 1, 8)


@dataclass(frozen=True)
class Step5Sizes:
    """Step5 DSA steps (strategies.step5_batches): decodes only. Interpreted on a CPU, each (token, KV group) row's
    attention costs ~(topk + 1) x 8 gathered tokens and its scoring ~ceil(regions / 128) tiles, so contexts stay
    within a few hundred regions and top-k small enough that selection cuts there too."""

    max_decodes: int
    max_context: int  # tokens before a request's last token
    topks: tuple[int, ...]  # sparse_config.topk (regions); the first is where shrinking goes
    block_sizes: tuple[int, ...] = (64, 16, 32, 128)
    max_steps: int = 9  # decode steps a case runs (9 crosses a region's close from anywhere)


@dataclass(frozen=True)
class Profile:
    name: str
    max_decodes: int  # decode requests (uniform query_len 1-4, MTP included)
    max_prefills: int  # extends and prefills after them
    max_tokens: int  # query tokens in the whole step
    max_context: int  # cached tokens per request
    topk_widths: tuple[int, ...]  # the first is where shrinking goes
    block_sizes: tuple[int, ...]
    dcp_sizes: tuple[int, ...] = (1, 2, 3, 4, 8)
    # Whole-backend targets run an attention kernel per case: interpreted, it costs ~1 ms per 16 heads x
    # 16 top-k entries x token, so CPU cases stay small.
    attn_max_tokens: int = 512
    attn_topk_widths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    attn_heads: tuple[int, ...] = (16, 8, 32, 64, 128)
    # Block ids anywhere in a cache of this many slots (0: from 1 up, as many blocks as the case needs): large
    # caches without long steps, so that offsets past 2^31 bytes show (bug class L).
    slot_pool: int = 0
    # Index top-k widths drawn only under a swarm, as the category `tile_edge`: just past where the index remap's
    # tiling changes (with valid counts, one tile for powers of two and up to 4096 entries; 128-wide tiles and
    # atomics for 4224, the first width past it).
    edge_topk_widths: tuple[int, ...] = ()
    # Steps per case for targets that run traces (strategies.traces), the case's own included: 1 is single
    # fresh steps only (`attnfuzz run --max-steps`).
    max_steps: int = 4
    dsv4: Dsv4Sizes = Dsv4Sizes(max_decodes=12, max_prefills=6, max_tokens=512, max_context=9000,
                                max_prefill_context=4096, max_prefill_compressed=4096, topk_widths=(512,),
                                window_sizes=(128,), heads=(16, 8, 32, 64, 128))
    indexer: IndexerSizes = IndexerSizes(max_decodes=16, max_prefills=4, max_tokens=256, max_context=8000,
                                         topk_widths=(2048, 512, 1024), heads=(64, 32), tight_logits_mb=4)
    step5: Step5Sizes = Step5Sizes(max_decodes=8, max_context=8192, topks=(512, 64, 16))

    def reaching_routes(self) -> "Profile":
        """This profile with steps long enough for a layer's routing thresholds: vLLM's sparse builders count a query
        of up to 128 tokens (16 or 32 heads) or 256 (64 and 128 heads, SM90) as a decode, and a prefill leaves for
        dense MHA only past that and within top-k. A CPU profile's steps (12 tokens) pass neither: steps of up to
        300 tokens, top-k 256 and heads 16, 32 and 64 there (the prefill tokens go to torch's attention, the decode
        ones to the stand-ins' torch kernels). SM100's 1024 (128 heads) needs FlashMLA's SM100 route: not driven here."""
        if self.attn_max_tokens >= 300:
            return self
        return replace(self, attn_max_tokens=300, attn_topk_widths=(256,), attn_heads=(16, 32, 64))

    def for_attention(self) -> "Profile":
        return replace(self, max_tokens=self.attn_max_tokens, topk_widths=self.attn_topk_widths,
                       max_decodes=min(self.max_decodes, self.attn_max_tokens))


PROFILES = {
    "cpu": Profile("cpu", max_decodes=4, max_prefills=3, max_tokens=72, max_context=1024,
                   topk_widths=(128, 256, 512, 1024, 2048, 2176), block_sizes=(64, 16, 32, 128),
                   attn_max_tokens=12, attn_topk_widths=(128, 256), attn_heads=(16, 8, 32),
                   edge_topk_widths=(4224,),
                   dsv4=Dsv4Sizes(max_decodes=3, max_prefills=2, max_tokens=10, max_context=1100,
                                  max_prefill_context=600, max_prefill_compressed=12, topk_widths=(128,),
                                  window_sizes=(32, 64), heads=(16, 8, 64, 128), max_speculative=3),
                   indexer=IndexerSizes(max_decodes=4, max_prefills=2, max_tokens=48, max_context=2600,
                                        topk_widths=(512, 2048, 256), heads=(64, 32)),
                   step5=Step5Sizes(max_decodes=3, max_context=800, topks=(8, 4, 16))),
    "gpu": Profile("gpu", max_decodes=12, max_prefills=4, max_tokens=512, max_context=4096,
                   topk_widths=(128, 256, 512, 1024, 2048, 2176), block_sizes=(64, 16, 32, 128),
                   edge_topk_widths=(4224, 8320)),
    # The throughput benchmark's envelope (issue 3): up to 16 requests, 4K context, top-k 512.
    # Scale on purpose (the H200's memory): caches past 2 GiB (over 3.3M fp8_ds_mla slots: block ids in the top
    # eighth of a 4.1M-slot pool, 64,000 blocks of 64), contexts up to 128K tokens, top-k 2048, block tables of
    # thousands of blocks per request, so that 32-bit offset overflow (bug class L) can show.
    "gpu-scale": Profile("gpu-scale", max_decodes=8, max_prefills=2, max_tokens=256, max_context=131072,
                         topk_widths=(2048,), block_sizes=(64,), attn_max_tokens=256, attn_topk_widths=(2048,),
                         slot_pool=64_000 * 64,
                         dsv4=Dsv4Sizes(max_decodes=8, max_prefills=2, max_tokens=256, max_context=131072,
                                        max_prefill_context=16384, max_prefill_compressed=4096, topk_widths=(512,),
                                        window_sizes=(128,), heads=(16, 64, 128))),
    "gpu-bench": Profile("gpu-bench", max_decodes=12, max_prefills=4, max_tokens=512, max_context=4096,
                         topk_widths=(512,), block_sizes=(64,), attn_topk_widths=(512,)),
}
