"""What a target saw when it ran one case. Targets fill it in; they never judge it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Observation:
    target: str
    device: str
    outputs: dict[str, Any] = field(default_factory=dict)  # tensors: on the CPU, or the device (outputs_stay_on_device)
    error_type: str | None = None  # exception raised by the code under test, if any
    error: str | None = None
    memory: list[Any] = field(default_factory=list)  # out-of-bounds accesses (interpreter sanitizer)
    real: tuple[str, ...] = ()  # vLLM functions/kernels that ran for real
    emulated: tuple[str, ...] = ()  # compiled ops replaced by attnfuzz stand-ins (must be reported)
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)  # call details the oracle needs (layout, flags)
