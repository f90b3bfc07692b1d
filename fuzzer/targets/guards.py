"""Guard regions around the buffers the harness owns (the paged KV cache, the top-k buffer, output buffers):
sentinel bytes before and after each, checked after the call. They catch a stray write just outside a buffer
on any device and without a sanitizer, at the cost of one comparison per guard; they stay on in every mode.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: fuzzer.targets.base imports this module, and `attnfuzz list` and `run`'s
# argument checks import that (for its declarations) without wanting torch's seconds of start-up.

GUARD_BYTES = 4096  # per side: a row of 576 bf16 is 1,152 bytes, so a few rows either way
SENTINEL = 0xA5  # a byte no harness buffer is filled with


class Guards:
    def __init__(self) -> None:
        self._regions: list[tuple[str, torch.Tensor, int, int]] = []  # (name, raw bytes, guard, body)
        self.enabled = os.environ.get("ATTNFUZZ_GUARDS", "1") != "0"  # 0: off, to measure what they cost

    def empty(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A flat buffer of `numel` elements with guard bytes on both sides (contents: the sentinel)."""
        import torch

        if not self.enabled:
            return torch.empty(numel, dtype=dtype, device=device)
        item = torch.empty((), dtype=dtype).element_size()
        guard = -(-GUARD_BYTES // item) * item
        body = numel * item
        raw = torch.full((guard * 2 + body,), SENTINEL, dtype=torch.uint8, device=device)
        self._regions.append((name, raw, guard, body))
        return raw[guard:guard + body].view(dtype)

    def check(self) -> list[str]:
        """One message per buffer whose guards changed."""
        found = []
        for name, raw, guard, body in self._regions:
            before = (raw[:guard] != SENTINEL).nonzero()
            after = (raw[guard + body:] != SENTINEL).nonzero()
            if len(before):
                found.append(f"guard region before `{name}` overwritten: {len(before)} bytes, the first "
                             f"{guard - int(before[0])} bytes before it")
            if len(after):
                found.append(f"guard region after `{name}` overwritten: {len(after)} bytes, the first "
                             f"{int(after[0])} bytes after its end")
        return found


# -- memory vLLM allocates itself ----------------------------------------------------------------------------
# Guard regions and poison cover the harness's buffers. What vLLM or a kernel library allocates with
# torch.empty and never writes is another matter: natively it holds whatever PyTorch's caching allocator hands
# out, and under compute-sanitizer (allocator off) fresh driver memory, which reads as zeros, so an oracle that
# expects 0 there can pass by luck (initcheck reports such reads).
# ATTNFUZZ_POISON_ALLOCATOR=1 fills the allocator's free memory with 0xFF before each call, so such a read
# gives NaN (bf16, fp16, fp32) or -1 (signed ints) and shows up natively. Opt-in while its findings are triaged.
POISON_BYTE = 0xFF
POISON_LARGE_BYTES = 1 << 30  # the large pool: one block, split for every allocation over 1 MiB
POISON_SMALL_BLOCKS = 32  # the small pool (allocations up to 1 MiB): 2 MiB segments, two blocks each


def allocator_poisoning(device) -> bool:
    """Whether `poison_free_memory` does anything here: CUDA, the caching allocator on, and asked for."""
    return (str(device).startswith("cuda") and os.environ.get("ATTNFUZZ_POISON_ALLOCATOR", "0") == "1"
            and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") != "1")


def poison_free_memory(device) -> bool:
    """Fill what the caching allocator hands out next with POISON_BYTE; returns whether it did."""
    if not allocator_poisoning(device):
        return False
    import torch

    torch.cuda.empty_cache()  # the free blocks go back to the driver: only poisoned ones stay cached
    held = [torch.empty(POISON_LARGE_BYTES, dtype=torch.uint8, device=device)]
    held += [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(POISON_SMALL_BLOCKS)]
    for block in held:
        block.fill_(POISON_BYTE)
    del held  # freed into the pools, stream-ordered after the fills
    return True
