"""Guard regions around the buffers the harness owns (the paged KV cache, the top-k buffer, output buffers):
sentinel bytes before and after each, checked after the call. They catch a stray write just outside a buffer
on any device and without a sanitizer, at the cost of one comparison per guard; they stay on in every mode.
"""

from __future__ import annotations

import os

import torch

GUARD_BYTES = 4096  # per side: a row of 576 bf16 is 1,152 bytes, so a few rows either way
SENTINEL = 0xA5  # a byte no harness buffer is filled with


class Guards:
    def __init__(self) -> None:
        self._regions: list[tuple[str, torch.Tensor, int, int]] = []  # (name, raw bytes, guard, body)
        self.enabled = os.environ.get("ATTNFUZZ_GUARDS", "1") != "0"  # 0: off, to measure what they cost

    def empty(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A flat buffer of `numel` elements with guard bytes on both sides (contents: the sentinel)."""
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
