"""A DeepSeek-V4 step (Case.dsv4) -> tensors, deterministically from the case's seed, on any device; and the
caches as the model leaves them before its attention call, written in torch.

The model writes its caches before `forward_mqa`: the fused q-norm/RoPE/insert writes each new token's latent
into the sliding-window (SWA) cache, the compressor each completed compressed entry into the compressed K cache,
both as 584-byte records (`write_v4_records`, byte-equal to vLLM's Triton `quantize_and_insert_k_cache`; a test
holds them together). A token's K (= V) is a 512-wide bf16 latent per request and position; a compressed entry's a
512-wide latent per request and entry. No vLLM import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from strategies.case import PLAIN_BF16_RECORD, PLAIN_FP8_RECORD, Case
from strategies.tensors import FP8_MAX, to_e4m3

HEAD_DIM = 512  # DeepSeek-V4's latent: 448 NoPE + 64 RoPE; K = V
NOPE, ROPE, QUANT_BLOCK = 448, 64, 64
DATA_BYTES, SCALE_BYTES, ENTRY_BYTES = 576, 8, 584  # a record: 448 fp8 + 64 bf16, then 7 UE8M0 exponents + pad
POISON = 255  # an unwritten cache byte: fp8 NaN, a NaN UE8M0 scale
TOPK_POISON = 2**30 - 1  # top-k buffer rows no step's token owns
_VALUE_SCALE = {"normal": 1.0, "large": 8.0, "tiny": 2e-5, "zero_tiles": 1.0}  # tiny: under the 1e-4 floor


# DeepSeek-V4's RoPE (its config.json, which vLLM's tiny test config and V4.1's share): GPT-J RoPE over the last 64 of
# the 512 dims, theta 10000 on sliding-window layers and 160000 on compressed ones.
ROPE_DIM, ROPE_THETA, COMPRESS_ROPE_THETA = 64, 10000.0, 160000.0


def gptj_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA,
              inverse: bool = False) -> torch.Tensor:
    """GPT-J (interleaved) RoPE of the last 64 dims of x [tokens, heads, 512] at each token's position (or taken back
    out, `inverse`): pair i = the last 64's dims (2i, 2i + 1) turned by position x theta^(-2i/64), from an fp32 cos/sin
    table as vLLM's rotary caches hold it (padding tokens have position 0)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))
    freqs = positions.long().cpu().float()[:, None] * inv_freq[None]
    cs = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=x.device, dtype=x.dtype)
    c, s = cs[:, None, : ROPE_DIM // 2], cs[:, None, ROPE_DIM // 2:] * (-1 if inverse else 1)
    out = x.clone()
    even, odd = x[..., -ROPE_DIM::2], x[..., -ROPE_DIM + 1::2]
    out[..., -ROPE_DIM::2] = even * c - odd * s
    out[..., -ROPE_DIM + 1::2] = odd * c + even * s
    return out


def padded_heads(heads: int) -> int:
    """The q/output heads FlashMLA's DSv4 kernels take: 64 or 128 (DeepseekV4FlashMLAAttention pads to them)."""
    return 64 if heads <= 64 else 128


V41_ENTRY_BYTES, V41_DATA_BYTES, V41_QUANT_BLOCK = 528, 512, 32  # V4.1's MXFP8 record (SM100): 512 fp8, 16 UE8M0
# V4.1's NVFP4 compressed record (`nvfp4_ds_mla`, SM100): 512 e2m1 two a byte, 32 e4m3 scales of 16 values each
V41_NVFP4_ENTRY_BYTES, V41_NVFP4_PACKED, V41_NVFP4_BLOCK = 288, 256, 16
PLAIN_RECORDS = {PLAIN_BF16_RECORD: torch.bfloat16, PLAIN_FP8_RECORD: torch.float8_e4m3fn}  # FlashInfer's rows


def page_bytes(entries_per_block: int, record: int = ENTRY_BYTES, pad: int = 0) -> int:
    """A page of the 584-byte layout: the entries' data rows, their scale rows, padded to a multiple of 576; of
    V4.1's 528-byte one: whole interleaved records, padded to a multiple of 512; of a plain-row cache (a bf16 or
    per-tensor fp8 row a token, FlashInfer's layout): its entries' rows, then `pad` rows of the packed page's other
    components (vLLM's packed KV layout)."""
    if record in PLAIN_RECORDS:
        return (entries_per_block + pad) * record
    if record in (V41_ENTRY_BYTES, V41_NVFP4_ENTRY_BYTES):
        return -(-entries_per_block * record // 512) * 512
    return -(-entries_per_block * ENTRY_BYTES // DATA_BYTES) * DATA_BYTES


@dataclass(frozen=True)
class Dsv4Inputs:
    positions: torch.Tensor  # int64 [num_actual_tokens]: each token's position (padding tokens: 0)
    token_request: torch.Tensor  # int64 [num_actual_tokens]: the request of each token, -1 for padding tokens
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]: each token's SWA slot (-1: padding)
    block_table: torch.Tensor  # int32: the SWA cache's (Case.block_table)
    compressed_block_table: torch.Tensor | None  # int32: the compressed K cache's (None: ratio 1)
    swa_values: tuple[torch.Tensor, ...]  # per request bf16 [seq_len, 512]: the latent of each position
    compressed_values: tuple[torch.Tensor, ...]  # per request bf16 [seq_len // ratio, 512]: each compressed entry
    topk_indices: torch.Tensor  # int32 [num_actual_tokens, index_topk]: the C4 indexer's rows (local entry ids)
    q: torch.Tensor  # bf16 [num_actual_tokens, padded heads, 512]: zeros past the case's heads
    attn_sink: torch.Tensor  # fp32 [padded heads]: -inf past the case's heads (make_attention_sink's init)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def swa_slots(case: Case, req: int, positions: torch.Tensor) -> torch.Tensor:
    """The SWA cache slots of request `req`'s positions: block_table[row][p // block_size] * block_size + offset."""
    row = torch.tensor(case.block_table[case.table_row(req)], dtype=torch.int64)
    return row[positions // case.block_size] * case.block_size + positions % case.block_size


def compressed_slots(case: Case, req: int, entries: torch.Tensor) -> torch.Tensor:
    """The compressed K cache slots of request `req`'s compressed entries (compressed_block_size // ratio entries a block)."""
    per_block = case.dsv4.entries_per_block
    row = torch.tensor(case.dsv4.compressed_block_table[case.table_row(req)], dtype=torch.int64)
    return row[entries // per_block] * per_block + entries % per_block


def written_swa_positions(case: Case, req: int) -> torch.Tensor:
    """The positions the SWA cache holds for request `req`: those whose block the table still holds (a block
    wholly behind the window may be back in the pool, its table entry the null block 0)."""
    r = case.requests[req]
    pos = torch.arange(r.seq_len)
    row = torch.tensor(case.block_table[case.table_row(req)] or (0,), dtype=torch.int64)
    return pos[row[pos // case.block_size] > 0] if r.seq_len else pos


def materialize_dsv4_inputs(case: Case, device: str | torch.device = "cpu") -> Dsv4Inputs:
    """Memoized per (case, device): the target and the oracle of one case share one materialization."""
    return _inputs(case, str(torch.device(device)))


@functools.lru_cache(maxsize=4)  # a side-by-side target's backends each take their own form of one step
def _inputs(case: Case, device: str) -> Dsv4Inputs:
    d = case.dsv4
    g = torch.Generator().manual_seed(case.seed)
    # Latents are drawn on the device by its own generator (a long-context GPU step holds hundreds of MB of them):
    # a case holds the same values wherever it runs on the same kind of device.
    gd = torch.Generator(device=device).manual_seed(case.seed + 1)
    scale = _VALUE_SCALE[case.values]
    swa, comp = [], []
    for r in case.requests:
        swa.append(_latents(r.seq_len, scale, case.values, gd, device, d.latent_grid))
        comp.append(_latents(r.seq_len // d.compress_ratio if d.compressed else 0, scale, case.values, gd, device,
                             d.latent_grid))
    positions, token_req, slots, qsl = [], [], [], [0]
    for i, r in enumerate(case.requests):
        pos = torch.arange(r.context_len, r.seq_len)
        positions.append(pos)
        token_req.append(torch.full((r.query_len,), i, dtype=torch.int64))
        slots.append(swa_slots(case, i, pos))
        qsl.append(qsl[-1] + r.query_len)
    pad = case.padded_tokens
    positions = torch.cat([*positions, torch.zeros(pad, dtype=torch.int64)])
    token_req = torch.cat([*token_req, torch.full((pad,), -1, dtype=torch.int64)])
    slots = torch.cat([*slots, torch.full((pad,), -1, dtype=torch.int64)])
    topk = _indexer_rows(case, positions, token_req, g)
    hp = padded_heads(case.heads)
    q = torch.zeros(len(positions), hp, HEAD_DIM)
    q[:, : case.heads] = torch.randn(len(positions), case.heads, HEAD_DIM, generator=g)
    if d.q_rope_removed:  # the mega kernel ropes q itself (theta 10000): it is handed q with its RoPE taken out
        q = gptj_rope(q.to(torch.bfloat16).float(), positions, ROPE_THETA, inverse=True)
    sink = torch.full((hp,), float("-inf"))
    if d.attn_sink == "finite":
        sink[: case.heads] = torch.randn(case.heads, generator=g) * 2
    elif d.attn_sink == "large":
        sink[: case.heads] = 6 + torch.rand(case.heads, generator=g) * 2
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return Dsv4Inputs(
        positions=positions.to(device), token_request=token_req.to(device), query_start_loc=i32(qsl),
        seq_lens=i32([r.seq_len for r in case.requests]), slot_mapping=slots.to(device),
        block_table=i32(case.block_table),
        compressed_block_table=i32(d.compressed_block_table) if d.compressed else None,
        swa_values=tuple(swa), compressed_values=tuple(comp),
        topk_indices=topk.to(device), q=q.to(torch.bfloat16).to(device), attn_sink=sink.to(device))


def _latents(n: int, scale: float, values: str, g: torch.Generator, device: str, grid: int = 0) -> torch.Tensor:
    x = torch.randn(n, HEAD_DIM, generator=g, device=device) * scale
    if values == "zero_tiles" and n:  # whole 64-wide quantization blocks of zeros (the scale's 1e-4 floor)
        blocks = x[:, :NOPE].view(n, NOPE // QUANT_BLOCK, QUANT_BLOCK)
        blocks[torch.rand(n, NOPE // QUANT_BLOCK, generator=g, device=device) < 0.5] = 0
    return record_values(x.to(torch.bfloat16), grid) if grid else x.to(torch.bfloat16)


def record_values(k: torch.Tensor, record: int) -> torch.Tensor:
    """bf16 [n, 512] -> bf16 [n, 512]: what a 584-byte (V4) or 528-byte (V4.1 MXFP8) record written from k decodes
    to. Exact in bf16 (an e4m3 value times a power of two), and written again it decodes to itself: a plain bf16 row
    and the record hold the same values (`Dsv4.latent_grid`)."""
    width, cols = (QUANT_BLOCK, NOPE) if record == ENTRY_BYTES else (V41_QUANT_BLOCK, V41_DATA_BYTES)
    fp8, exponent = _e4m3_blocks(k[:, :cols].float(), width)
    values = (fp8.float() * torch.exp2(exponent)[..., None]).view(len(k), cols)
    return torch.cat([values, k[:, cols:].float()], dim=-1).to(torch.bfloat16)


def _e4m3_blocks(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [n, c] -> (float8_e4m3fn [n, c // width, width], exponents [n, c // width]) as vLLM's Triton writers
    quantize each `width`-wide block: e = ceil(log2(max(amax, 1e-4) / 448)), the block as e4m3 of clamp(x / 2^e)."""
    blocks = x.view(len(x), x.shape[1] // width, width)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX))
    return to_e4m3(blocks / torch.exp2(exponent)[..., None]), exponent


def c4_valid_count(position: int, index_topk: int, ratio: int = 4) -> int:
    """Valid ids of an indexer row at `position` (C4A; V4.1's C1A, C2A): every visible compressed entry, up to
    index_topk."""
    return min((position + 1) // ratio, index_topk)


def _indexer_rows(case: Case, positions: torch.Tensor, token_req: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The indexer's top-k rows (C4A; V4.1's C1A and C2A, ratio R): min(n, index_topk) distinct local ids of the
    n = (p + 1) // R visible compressed entries, valid ids first, -1 after (sparse_attn_indexer's top_k_per_row, and
    the short-context fill, which gives 0, 1, ..., n - 1); padding tokens select nothing. Layers that do not read the
    buffer get rows out of range, so that a read shows."""
    d, width = case.dsv4, case.topk_width
    if not d.indexed:
        return torch.full((len(positions), width), TOPK_POISON, dtype=torch.int32)
    rows = torch.full((len(positions), width), -1, dtype=torch.int32)
    for t, (p, r) in enumerate(zip(positions.tolist(), token_req.tolist())):
        if r < 0:
            continue
        n, k = (p + 1) // d.compress_ratio, c4_valid_count(p, width, d.compress_ratio)
        ids = torch.arange(k) if d.c4_order == "ascending" else torch.randperm(n, generator=g)[:k]
        rows[t, :k] = ids.to(torch.int32)
    return rows


# -- the caches, as the model writes them ---------------------------------------------------------------------
def v4_records(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [n, 512] -> (data uint8 [n, 576], scales uint8 [n, 8]) as quantize_and_insert_k_kernel writes them: per
    64-wide NoPE block the exponent e = ceil(log2(max(amax, 1e-4) / 448)) (fp32), the block as float8_e4m3fn of
    clamp(x / 2^e, +-448), e + 127 its scale byte (the 8th byte 0); the RoPE part as bf16."""
    fp8, exponent = _e4m3_blocks(k[:, :NOPE].float(), QUANT_BLOCK)
    data = torch.cat([fp8.view(torch.uint8).view(-1, NOPE), k[:, NOPE:].contiguous().view(torch.uint8)], dim=-1)
    scales = torch.zeros(len(k), SCALE_BYTES, dtype=torch.uint8, device=k.device)
    scales[:, : NOPE // QUANT_BLOCK] = (exponent + 127).clamp(0, 255).to(torch.uint8)
    return data, scales


def write_v4_records(pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, entries_per_block: int) -> None:
    """Write bf16 [n, 512] at `slots` of a raw cache pages uint8 [num_blocks, page bytes]: slot s's data row at byte
    (s % entries) * 576 of page s // entries, its scale row at entries * 576 + (s % entries) * 8."""
    if not len(slots):
        return
    data, scales = v4_records(k)
    slots = slots.to(pages.device).long()
    block, offset = slots // entries_per_block, slots % entries_per_block
    cols = offset[:, None] * DATA_BYTES + torch.arange(DATA_BYTES, device=pages.device)
    pages[block[:, None], cols] = data
    cols = entries_per_block * DATA_BYTES + offset[:, None] * SCALE_BYTES + torch.arange(SCALE_BYTES, device=pages.device)
    pages[block[:, None], cols] = scales


def v41_records(k: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 512] -> records uint8 [n, 528] as vLLM's `_quantize_and_insert_k_mxfp8_kernel` writes them: per
    32-wide block the exponent e = ceil(log2(max(amax, 1e-4) / 448)) (fp32), the block as float8_e4m3fn of
    clamp(x / 2^e, +-448), then the 16 bytes e + 127."""
    fp8, exponent = _e4m3_blocks(k.float(), V41_QUANT_BLOCK)
    return torch.cat([fp8.view(torch.uint8).view(-1, V41_DATA_BYTES), (exponent + 127).clamp(0, 255).to(torch.uint8)],
                     dim=-1)


def write_v41_records(pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, entries_per_block: int) -> None:
    """Write bf16 [n, 512] at `slots` of a raw cache of 528-byte records: slot s's whole record (data, then its
    scales) at byte (s % entries) * 528 of page s // entries."""
    if not len(slots):
        return
    slots = slots.to(pages.device).long()
    cols = (slots % entries_per_block)[:, None] * V41_ENTRY_BYTES + torch.arange(V41_ENTRY_BYTES, device=pages.device)
    pages[(slots // entries_per_block)[:, None], cols] = v41_records(k)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 e2m1 codes (sign in bit 3) as `cvt.rn.satfinite.e2m1x2.f32` rounds: to nearest, ties to the
    even code, magnitudes past 6 to 6, the sign kept (-0.0 and values that round to 0 from below are code 8)."""
    m = x.abs()
    # Each bound: the magnitude from which the next code is taken; a tie goes up where the upper code is even.
    code = ((m > 0.25).to(torch.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5.0))
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def v41_nvfp4_records(k: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 512] -> records uint8 [n, 288] as vLLM's `_rope_quant_insert_nvfp4_kernel` writes them (after its
    RoPE, which the value here already carries): per 16-wide block the scale e4m3(clamp(amax * fp32(1/6), 2^-9,
    448)), each value divided by it (IEEE, div_rn) and rounded to e2m1, two a byte (the even element low), then
    the 32 scale bytes."""
    tiles = k.float().view(-1, V41_DATA_BYTES // V41_NVFP4_BLOCK, V41_NVFP4_BLOCK)
    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=k.device)
    scale = (tiles.abs().amax(dim=-1) * sixth).clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_codes(tiles / scale.float()[..., None]).view(-1, V41_NVFP4_PACKED, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return torch.cat([packed, scale.view(torch.uint8)], dim=-1)


def write_v41_nvfp4_records(pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, entries_per_block: int) -> None:
    """Write bf16 [n, 512] at `slots` of a raw cache of 288-byte records: slot s's record at byte (s % entries) * 288
    of page s // entries."""
    if not len(slots):
        return
    slots = slots.to(pages.device).long()
    cols = ((slots % entries_per_block)[:, None] * V41_NVFP4_ENTRY_BYTES
            + torch.arange(V41_NVFP4_ENTRY_BYTES, device=pages.device))
    pages[(slots // entries_per_block)[:, None], cols] = v41_nvfp4_records(k)


def plain_rows(k: torch.Tensor, record: int) -> torch.Tensor:
    """bf16 [n, 512] -> uint8 [n, record]: the plain row FlashInfer's DeepSeek-V4 layer stores (its fused insert,
    `_fused_qnorm_rope_kv_insert`'s plain-row path): the bf16 value as is, or per-tensor e4m3 of value / k_scale with
    k_scale 1.0 (the layer's `_flashinfer_fp8_kv_scale`), saturated to +-448."""
    if record == PLAIN_BF16_RECORD:
        return k.to(torch.bfloat16).contiguous().view(torch.uint8)
    return to_e4m3(k).view(torch.uint8)


def write_plain_rows(pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, entries_per_block: int,
                     record: int = PLAIN_BF16_RECORD) -> None:
    """Write bf16 [n, 512] at `slots` of a raw plain-row cache: slot s's row at byte (s % entries) * record of page
    s // entries (a packed page's rows past its entries belong to other components and stay as they were)."""
    if not len(slots):
        return
    slots = slots.to(pages.device).long()
    cols = (slots % entries_per_block)[:, None] * record + torch.arange(record, device=pages.device)
    pages[(slots // entries_per_block)[:, None], cols] = plain_rows(k, record)


def _writer(case: Case, record: int | None = None):
    record = record or case.dsv4.kv_record
    if record == V41_NVFP4_ENTRY_BYTES:
        return write_v41_nvfp4_records
    if record in PLAIN_RECORDS:
        return functools.partial(write_plain_rows, record=record)
    return write_v41_records if record == V41_ENTRY_BYTES else write_v4_records


def swa_pages(case: Case, inputs: Dsv4Inputs, num_blocks: int, device) -> torch.Tensor:
    """The SWA cache, poisoned (0xFF) where the model wrote nothing, holding every position its table keeps."""
    pages = torch.full((num_blocks, page_bytes(case.block_size, case.dsv4.kv_record, case.dsv4.page_pad)), POISON,
                       dtype=torch.uint8, device=device)
    write = _writer(case)
    for i, _ in enumerate(case.requests):
        pos = written_swa_positions(case, i)
        write(pages, swa_slots(case, i, pos), inputs.swa_values[i][pos.to(inputs.swa_values[i].device)],
                         case.block_size)
    return pages


def compressed_pages(case: Case, inputs: Dsv4Inputs, num_blocks: int, device) -> torch.Tensor:
    """The compressed K cache, poisoned where the compressor wrote nothing, holding each request's seq_len // ratio
    completed entries (the compressor writes those of the step's own tokens before the attention call)."""
    per_block, record = case.dsv4.entries_per_block, case.dsv4.compressed_record
    pages = torch.full((num_blocks, page_bytes(per_block, record, case.dsv4.page_pad)), POISON,
                       dtype=torch.uint8, device=device)
    write = _writer(case, record)
    for i, _ in enumerate(case.requests):
        entries = torch.arange(len(inputs.compressed_values[i]))
        write(pages, compressed_slots(case, i, entries), inputs.compressed_values[i], per_block)
    return pages


def num_blocks(table) -> int:
    return 1 + max((b for row in table for b in row), default=0)


