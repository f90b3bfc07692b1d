"""compute-sanitizer: finding it, the command a sanitized worker runs under, and its reports as data.

Reports are parsed from compute-sanitizer's log (one block per error: a header line, then indented detail
lines) into `SanitizerReport`s: tool, error kind, kernel, source file and line, access size, distance from the
nearest allocation, thread and block. PyTorch's caching allocator hides out-of-bounds accesses inside its
pooled segments (memcheck saw 0 errors of the seed bug with it, 1,282 without), so every sanitized worker runs
with PYTORCH_NO_CUDA_MEMORY_CACHING=1 and without expandable segments (false "Invalid write" reports).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass

from fuzzer.errors import SanitizerUnavailable

TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
# What a worker under compute-sanitizer must have in its environment, and must not.
SANITIZED_ENV = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
SANITIZED_ENV_REMOVE = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # expandable_segments lives there
# Without the caching allocator every allocation is a cudaMalloc, which a stream capture refuses
# (cudaErrorStreamCaptureUnsupported): a full-graph case fails in its capture, whatever vLLM does. Sanitized cases
# run eagerly; full graphs are fuzzed natively (guard regions, poisoned buffers).
EAGER_ONLY = ("a sanitized worker runs without PyTorch's caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1), and a "
              "CUDA-graph capture cannot allocate without it")


def find_compute_sanitizer() -> str:
    """The compute-sanitizer binary: cuda-python's pathfinder first (wheels and toolkits), then PATH."""
    path = None
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        path = find_nvidia_binary_utility("compute-sanitizer")
    except Exception:  # older cuda-python without the binary finder, or not installed
        path = None
    path = path or shutil.which("compute-sanitizer")
    if not path:
        for candidate in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/cuda/bin/compute-sanitizer"):
            if os.access(candidate, os.X_OK):
                path = candidate
                break
    if not path:
        raise SanitizerUnavailable("compute-sanitizer not found (cuda.pathfinder, PATH, /usr/local/cuda/bin)")
    return path


def check_driver() -> dict:
    """Driver version and device count through cuda-python's driver bindings; raises if there is no device."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise SanitizerUnavailable(f"cuda-python (cuda.bindings) is not importable: {e}") from e
    (err,) = driver.cuInit(0)
    if int(err) != 0:
        raise SanitizerUnavailable(f"cuInit failed: {err}")
    err, version = driver.cuDriverGetVersion()
    err2, count = driver.cuDeviceGetCount()
    if int(err2) != 0 or count < 1:
        raise SanitizerUnavailable(f"no CUDA device ({err2}, count {count})")
    return {"driver_version": f"{version // 1000}.{version % 1000 // 10}", "devices": count}


PRINT_LIMIT = 20_000  # reports a worker prints before compute-sanitizer goes quiet (see limit_reached)


def sanitizer_command(tool: str, binary: str | None = None, log_file: str | None = None) -> list[str]:
    """compute-sanitizer and its options; reports go to the process's own output unless `log_file`."""
    if tool not in TOOLS:
        raise ValueError(f"unknown compute-sanitizer tool {tool!r}; known: {', '.join(TOOLS)}")
    # The print limit counts over the whole (persistent) worker: past it, every case would read as clean. So
    # the worker is retired once it has printed half of it (`limit_reached`), and a fresh one goes on.
    cmd = [binary or find_compute_sanitizer(), "--tool", tool, "--print-limit", str(PRINT_LIMIT), "--show-backtrace", "no"]
    if tool == "memcheck":  # unused bytes after each allocation: a short overrun lands there, not in a neighbour
        cmd += ["--padding", "256"]
    if log_file:
        cmd += ["--log-file", log_file]
    if tool == "memcheck":
        cmd += ["--leak-check", "no"]
    if tool == "initcheck":
        # FlashMLA's SM90 kernels store through the TMA unit, which initcheck does not see (its --check-bulk-copy
        # is on by default and changes nothing). Outputs: the FlashMLA targets fill them first
        # (flashmla_runtime.prefill_outputs_under_initcheck). The split-KV accumulators are FlashMLA's own,
        # written by its split kernel and read only by its combine kernel: that kernel is not checked.
        for kernel in INITCHECK_BLIND_KERNELS:
            if accepts(cmd[0], ["--tool", "initcheck", "--kernel-name-exclude", f"kns={kernel}"]):
                cmd += ["--kernel-name-exclude", f"kns={kernel}"]
    # More options for a diagnosis (e.g. "--show-backtrace host"). compute-sanitizer refuses an option given
    # twice, so one of ours that is given again takes the new value.
    return _merge_options(cmd, shlex.split(os.environ.get("ATTNFUZZ_SANITIZER_OPTIONS", "")))


# Kernels initcheck cannot judge: every read they make is of memory another kernel wrote through TMA.
INITCHECK_BLIND_KERNELS = ("flash_fwd_mla_combine_kernel",)


@functools.cache
def _accepts(binary: str, options: tuple[str, ...]) -> bool:
    try:
        # `true` makes no CUDA call: without --require-cuda-init no, every option set would read as refused
        run = [binary, "--require-cuda-init", "no", *options, "true"]
        return subprocess.run(run, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def accepts(binary: str, options: list[str]) -> bool:
    """Whether this compute-sanitizer runs `true` with `options` (option syntax changes between releases)."""
    return _accepts(binary, tuple(options))


def _merge_options(cmd: list[str], extra: list[str]) -> list[str]:
    cmd = list(cmd)
    i = 0
    while i < len(extra):
        flag = extra[i]
        value = extra[i + 1] if i + 1 < len(extra) and not extra[i + 1].startswith("-") else None
        i += 2 if value is not None else 1
        if flag in cmd and value is not None and cmd.index(flag) + 1 < len(cmd):
            cmd[cmd.index(flag) + 1] = value
        else:
            cmd += [flag] + ([value] if value is not None else [])
    return cmd


def print_limit() -> int:
    """The print limit the workers run with: ours, or the one ATTNFUZZ_SANITIZER_OPTIONS gives instead."""
    cmd = _merge_options(["--print-limit", str(PRINT_LIMIT)], shlex.split(os.environ.get("ATTNFUZZ_SANITIZER_OPTIONS", "")))
    return int(cmd[1])


def limit_reached(reports_printed: int) -> bool:
    """Whether a worker has printed so many reports that it should be replaced before its print limit blinds it."""
    return reports_printed >= print_limit() // 2


def sanitized_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    for k in SANITIZED_ENV_REMOVE:
        env.pop(k, None)
    env.update(SANITIZED_ENV)
    return env


@dataclass(frozen=True)
class SanitizerReport:
    tool: str
    kind: str  # e.g. "Invalid __global__ read", "Uninitialized __global__ memory read", "Race reported"
    kernel: str = ""
    file: str = ""
    line: int = 0
    access_size: int = 0
    thread: tuple[int, ...] = ()
    block: tuple[int, ...] = ()
    address: str = ""
    distance: str = ""  # "2,049 bytes after the nearest allocation at 0x... of size 1,024 bytes"
    symbol: str = ""  # the kernel's whole symbol, where it is more than its name (templates, parameters)
    text: str = ""  # the block as logged

    @property
    def signature(self) -> str:
        """One per bug: the tool, the kind and where in the source (not which thread)."""
        return f"{self.tool}:{self.kind}:{self.kernel}:{os.path.basename(self.file)}:{self.line}"

    def describe(self) -> str:
        where = (f"{self.kernel} ({os.path.basename(self.file)}:{self.line})" if self.file else self.kernel) or "?"
        size = f" of {self.access_size} bytes" if self.access_size else ""
        at = f", thread {self.thread} block {self.block}" if self.block else ""
        return f"{self.tool}: {self.kind}{size} in {where}{at}" + (f"; {self.distance}" if self.distance else "")

    def to_dict(self) -> dict:
        return asdict(self)


_HEADER = re.compile(r"^=========\s(?!\s)(?P<text>.+)$")
_DETAIL = re.compile(r"^=========\s{2,}(?P<text>.*)$")
_KIND_SIZE = re.compile(r"^(?P<kind>.+?) of size (?P<size>[\d,]+) bytes?")
_HOST_ACCESS = re.compile(r" at host access to 0x[0-9a-f]+$")  # host API errors name the address in the kind
_API = re.compile(r"on access by (?P<api>.+)$")  # "Uninitialized access to 0x... on access by cudaMemcpy source"
# The device's error buffer overflowed: this case had more errors than were recorded (none of them printed).
RECORDS_DROPPED = "Warning: Error buffer overflow has been detected"
# "at KERNEL+0x140 in sparse_utils.py:152"; a kernel built without line info (FlashMLA's) gives only
# "at void smxx::decode::flash_fwd_mla_combine_kernel<...>(SparseAttnDecodeParams)+0x440".
_AT = re.compile(r"^at (?P<symbol>.+?)(?P<pc>\+0x[0-9a-f]+)?(?: in (?P<file>\S+?):(?P<line>\d+))?$")
# "6026752 errors were skipped (error buffer overflow)." at the end of a log: the same, counted.
_SKIPPED = re.compile(r"^[\d,]+ errors were skipped")
_THREAD = re.compile(r"by thread \((?P<thread>[\d, ]+)\) in block \((?P<block>[\d, ]+)\)")
_ADDRESS = re.compile(r"(?:Access to|Address) (?P<address>0x[0-9a-f]+)")
_DISTANCE = re.compile(r"and is (?P<distance>.+)$")
_NOT_ERRORS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "Target application returned", "Saved host backtrace",
               "LEAK SUMMARY", "Program hit", "Host Frame",
               "Error: process didn't terminate")


def kernel_name(symbol: str) -> str:
    """A kernel's name without return type, template arguments and parameters: one name for every
    instantiation, so that one bug in a templated kernel is one signature (the symbol stays in the report)."""
    name = symbol[5:] if symbol.startswith("void ") else symbol
    depth = 0  # inside a leading "(anonymous namespace)"
    for i, c in enumerate(name):
        if c in "<(":
            if depth == 0 and i > 0:
                return name[:i]
            depth += 1
        elif c in ">)":
            depth -= 1
    return name


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def parse_log(text: str, tool: str = "memcheck") -> list[SanitizerReport]:
    """Every error block in a compute-sanitizer log, in order."""
    reports, block = [], None

    def flush():
        if block:
            reports.append(_report(tool, block))

    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and not line.startswith("=========  "):
            flush()
            head = h.group("text").strip()
            block = [head] if head and not head.startswith(_NOT_ERRORS) else None
            continue
        d = _DETAIL.match(line)
        if d and block is not None:
            block.append(d.group("text").strip())
    flush()
    return reports


def _report(tool: str, lines: list[str]) -> SanitizerReport:
    head = lines[0]
    m = _KIND_SIZE.match(head)
    kind, size = (m.group("kind"), int(m.group("size").replace(",", ""))) if m else (head.rstrip(". "), 0)
    kind = _HOST_ACCESS.sub("", kind)
    fields: dict = {}
    if head.startswith(RECORDS_DROPPED) or _SKIPPED.match(head):
        kind, fields["kernel"] = "error records dropped (the device's error buffer overflowed)", "?"
    if (a := re.search(r" at (?P<kernel>[^\s+]+)(?:\+0x[0-9a-f]+)? in (?P<file>\S+?):(?P<line>\d+)", head)):
        fields.update(kernel=a.group("kernel"), file=a.group("file"), line=int(a.group("line")))  # racecheck
    for line in lines[1:]:
        if line.startswith(("Host Frame", "Saved host backtrace")):
            continue
        if (a := _AT.search(line)) and "kernel" not in fields:
            fields.update(kernel=kernel_name(a.group("symbol")), file=a.group("file") or "", line=int(a.group("line") or 0))
            if a.group("symbol") != fields["kernel"]:
                fields["symbol"] = a.group("symbol")
        if t := _THREAD.search(line):
            fields.update(thread=_ints(t.group("thread")), block=_ints(t.group("block")))
        if (ad := _ADDRESS.search(line)) and "address" not in fields:
            fields["address"] = ad.group("address")
        if dist := _DISTANCE.search(line):
            fields["distance"] = dist.group("distance")
        if (api := _API.search(line)) and "kernel" not in fields:  # a host API call, not a kernel, made the access
            fields["kernel"] = api.group("api")
    text = "\n".join(x for x in lines if not x.startswith("Host Frame"))
    return SanitizerReport(tool=tool, kind=kind, access_size=size, text=text, **fields)


def dedupe(reports: list[SanitizerReport]) -> list[SanitizerReport]:
    """The first report of each signature (the rest are the same bug on other threads)."""
    seen, out = set(), []
    for r in reports:
        if r.signature not in seen:
            seen.add(r.signature)
            out.append(r)
    return out
