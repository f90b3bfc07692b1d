"""Errors are types (fuzzer/errors.py): every exception class of attnfuzz is defined in one of three errors modules,
and a harness fault is told apart from what the code under test raised by its type, never by its message."""

import ast
import builtins
from types import SimpleNamespace

import pytest
import torch

from fuzzer.errors import (HarnessConfigError, HarnessError, HarnessFailure, MutantError, RankError, WorkerError,
                           WorkerInjectError, WorkerUnavailable)
from fuzzer.targets.base import Target, lost_device
from oracles.verdict import passed
from tests.conftest import ROOT

PACKAGES = ("strategies", "oracles", "fuzzer")
# fuzzer/errors.py, and the two families that cannot import it: strategies (floor 1, below it) and the support code
# reproducers ship without the rest of attnfuzz.
ERRORS_MODULES = {"fuzzer/errors.py", "strategies/errors.py", "fuzzer/support/errors.py"}
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _sources():
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), ast.parse(p.read_text())


def _base_name(node: ast.expr) -> str:
    """`Error` of `Error`, `torch.AcceleratorError`, `errors.Error`; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _exception_classes() -> dict[str, list[str]]:
    """Each exception class defined by a `class` statement in the tree: its name -> 'path:line' of each definition.
    A class is one when a base is a built-in exception, a name that reads as one (…Error, …Exception, …Warning,
    the stand-ins' CUDA_ERROR) or another class found here (to a fixed point)."""
    classes = [(path, node) for path, tree in _sources() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    found: dict[str, list[str]] = {}
    grew = True
    while grew:
        grew = False
        for path, node in classes:
            where = f"{path}:{node.lineno}"
            if where in found.get(node.name, []):
                continue
            bases = {_base_name(b) for b in node.bases}
            if any(b in BUILTIN_EXCEPTIONS or b in found or b.endswith(("Error", "Exception", "Warning"))
                   or b == "CUDA_ERROR" for b in bases):
                found.setdefault(node.name, []).append(where)
                grew = True
    return found


def test_every_exception_class_is_defined_in_an_errors_module():
    found = _exception_classes()
    assert {"UsageError", "HarnessError", "CaseError", "RankFailed", "EmptyLaunch"} <= set(found)  # the scan sees them
    outside = [f"{where}: class {name}" for name, wheres in sorted(found.items()) for where in wheres
               if where.rsplit(":", 1)[0] not in ERRORS_MODULES]
    assert not outside, ("exception classes outside fuzzer/errors.py (strategies/errors.py below its floor, "
                         "fuzzer/support/errors.py for the code reproducers ship):\n" + "\n".join(outside))


def test_the_scan_finds_exception_classes_however_they_are_based(tmp_path, monkeypatch):
    pkg = tmp_path / "fuzzer"
    pkg.mkdir()
    (pkg / "m.py").write_text("import torch\nclass A(ValueError): pass\nclass B(A): pass\n"
                              "class C(torch.AcceleratorError): pass\nclass D(KeyboardInterrupt): pass\n"
                              "class NotOne(object): pass\n")
    monkeypatch.setattr("tests.test_errors.ROOT", tmp_path)
    monkeypatch.setattr("tests.test_errors.PACKAGES", ("fuzzer",))
    assert set(_exception_classes()) == {"A", "B", "C", "D"}


def _handlers_that_read_messages():
    """(path:line) of each `except ... as e` whose body compares or searches e's text (`"x" in str(e)`,
    `str(e).startswith(...)`, `re.search(..., str(e))`): classifying an exception by its message."""
    def mentions(node: ast.AST, name: str) -> bool:
        return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))

    for path, tree in _sources():
        for handler in ast.walk(tree):
            if not isinstance(handler, ast.ExceptHandler) or not handler.name:
                continue
            for node in (n for stmt in handler.body for n in ast.walk(stmt)):
                if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                        and any(mentions(c, handler.name) for c in node.comparators):
                    yield f"{path}:{node.lineno}"
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("startswith", "endswith", "search", "match", "fullmatch", "find") \
                        and (mentions(node.func.value, handler.name) or any(mentions(a, handler.name) for a in node.args)):
                    yield f"{path}:{node.lineno}"


def test_no_handler_tells_exceptions_apart_by_their_message():
    offenders = list(_handlers_that_read_messages())
    assert not offenders, "exceptions classified by their message text (raise a type where it happens): " + \
        ", ".join(offenders)


def test_the_scan_finds_a_handler_that_reads_the_message(tmp_path, monkeypatch):
    pkg = tmp_path / "fuzzer"
    pkg.mkdir()
    (pkg / "m.py").write_text("""
def f(g):
    try:
        g()
    except AttributeError as e:
        if "SimpleNamespace" in str(e):
            raise
        if str(e).startswith("CUDA"):
            raise
        if isinstance(e.obj, dict) or e.name in ("a", "b"):
            raise
""")
    monkeypatch.setattr("tests.test_errors.ROOT", tmp_path)
    monkeypatch.setattr("tests.test_errors.PACKAGES", ("fuzzer",))
    assert list(_handlers_that_read_messages()) == ["fuzzer/m.py:6", "fuzzer/m.py:8"]


# -- a harness fault is told by its type -------------------------------------------------------------------------

class _Calls(Target):
    """A target whose case is whatever `call` does, for observe()."""
    name, summary, bug_classes = "test.calls", "observe() under test", ""
    oracle = staticmethod(lambda case, obs: [passed("test", "ran")])

    def __init__(self, call):
        super().__init__("cpu")
        self.call = call

    def unavailable(self):
        return None

    def cases(self, profile, plan=None):
        raise NotImplementedError

    def run(self, case):
        return self.observe(self.call)

    def repro_spec(self, finding):
        return None


def _raises(e: BaseException):
    def call():
        raise e
    return call


def test_an_attribute_attnfuzz_s_config_namespace_lacks_is_a_harness_fault_whatever_its_message():
    config = SimpleNamespace(block_size=64)
    with pytest.raises(HarnessConfigError, match="the config namespace lacks what this vLLM reads") as raised:
        _Calls(lambda: {"x": config.cache_dtype}).run(None)
    assert isinstance(raised.value, HarnessError)
    with pytest.raises(HarnessConfigError):  # the type of the object that lacks it decides, not the words
        _Calls(_raises(AttributeError("reworded by a wrapper", name="cache_dtype", obj=config))).run(None)
    with pytest.raises(HarnessConfigError, match="lacks a compiled op"):  # torch's op namespace: an op not built
        _Calls(lambda: {"x": torch.ops.attnfuzz_test_ops.not_registered}).run(None)


def test_an_attribute_error_of_the_code_under_test_is_an_observation_even_if_it_names_a_namespace():
    obs = _Calls(_raises(AttributeError("'types.SimpleNamespace' object has no attribute 'x'"))).run(None)
    assert obs.error_type == "AttributeError" and "SimpleNamespace" in obs.error
    obs = _Calls(_raises(AttributeError("'_OpNamespace' '_C' object has no attribute 'op'", obj=object()))).run(None)
    assert obs.error_type == "AttributeError"


def test_a_lost_device_is_told_by_the_exception_s_type_not_its_words():
    from fuzzer.run.worker import _device_lost, run_and_judge

    lost = _Calls(_raises(torch.AcceleratorError("an error")))  # what torch raises for any CUDA error
    obs, verdicts = run_and_judge(lost, None, lost=_device_lost)
    assert obs.notes["device_lost"] and [v.where for v in verdicts] == ["device_lost"]
    worded = _Calls(_raises(RuntimeError("CUDA error: an illegal memory access was encountered (AcceleratorError)")))
    obs, verdicts = run_and_judge(worded, None, lost=_device_lost)
    assert "device_lost" not in obs.notes and [v.check for v in verdicts] == ["test"]  # judged by the oracle
    assert lost_device(RankError("rank 1: AcceleratorError: CUDA error", device_lost=True))
    assert not lost_device(RankError("rank 1: AcceleratorError: CUDA error"))


def test_a_stand_in_s_failed_launch_is_the_error_pytorch_raises_for_it():
    from fuzzer.support.standins.cache_ops import EmptyLaunch

    assert issubclass(EmptyLaunch, torch.AcceleratorError) and lost_device(EmptyLaunch("CUDA error: invalid argument"))


def test_harness_faults_are_harness_errors_and_usage_faults_are_not():
    assert issubclass(HarnessConfigError, HarnessError) and issubclass(HarnessFailure, HarnessError)
    assert not issubclass(WorkerError, HarnessError) and not issubclass(MutantError, HarnessError)


def test_a_worker_s_start_up_failure_is_worded_by_its_type():
    from fuzzer.commands.run import worker_failure

    assert worker_failure(WorkerUnavailable("vllm.x", "needs 2 GPUs")) == "worker for vllm.x is not available here: needs 2 GPUs"
    assert worker_failure(WorkerInjectError("vllm.x", "--inject bad.py:3: KeyError: 'k'\nmore")) == \
        "--inject bad.py:3: KeyError: 'k'"
    other = WorkerError("worker for vllm.x: failed: Traceback ...\nfuzzer.errors.MutantError: words: unavailable: x")
    assert worker_failure(other) == str(other)  # words in a traceback classify nothing


def test_a_call_form_a_stand_in_does_not_model_is_could_not_test_not_vllm_s_answer():
    """fuzzer.support.errors.StandInRefused: a campaign stops with exit 2 (StandInUnmodelled, a HarnessError), and a
    reproducer's harness says "could not run"; told by its class, whatever its words. Any other NotImplementedError is
    vLLM's answer (an observation)."""
    from fuzzer.artifacts.repro_harness import vllms_answer
    from fuzzer.errors import StandInUnmodelled
    from fuzzer.support.errors import StandInRefused

    with pytest.raises(StandInUnmodelled, match="does not model DCP") as raised:
        _Calls(_raises(StandInRefused("attnfuzz's stand-in does not model DCP"))).run(None)
    assert isinstance(raised.value, HarnessError)
    obs = _Calls(_raises(NotImplementedError("FlashInferMLASparseImpl does not support ..."))).run(None)
    assert obs.error_type == "NotImplementedError"
    try:
        raise StandInRefused("not modelled")
    except StandInRefused as e:
        assert not vllms_answer(e)
    try:
        raise NotImplementedError("vLLM refuses")
    except NotImplementedError as e:
        assert vllms_answer(e)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU host's torch refusing a device query")
def test_a_device_query_a_cpu_host_cannot_answer_is_could_not_test_not_vllm_s_answer():
    """0.34's FlashMLASparseImpl asks torch.accelerator for its device index: on a CPU host torch raises a plain
    RuntimeError from inside torch.accelerator, which a campaign reports as DeviceQueryUnanswered (exit 2, naming the
    query) and a reproducer's harness as "could not run"; told by the raising frame, so the same words raised
    elsewhere stay vLLM's answer."""
    import torch

    from fuzzer.artifacts.repro_harness import vllms_answer
    from fuzzer.errors import DeviceQueryUnanswered, VllmCallMoved

    def asks():
        return {"x": torch.zeros(torch.accelerator.current_device_index())}

    with pytest.raises(DeviceQueryUnanswered, match="torch.accelerator.current_device_index") as raised:
        _Calls(asks).run(None)
    assert isinstance(raised.value, VllmCallMoved)  # printed and counted as COULD NOT TEST
    with pytest.raises(RuntimeError) as asked:
        asks()
    assert not vllms_answer(asked.value)
    worded = RuntimeError(str(asked.value))
    assert _Calls(_raises(worded)).run(None).error_type == "RuntimeError"
    try:
        raise worded
    except RuntimeError as e:
        assert vllms_answer(e)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU host's torch refusing pinned memory")
def test_pinned_memory_a_cpu_host_cannot_give_is_could_not_test_not_vllm_s_answer():
    """vLLM's host buffers ask for pinned memory (CpuGpuBuffer, `cpu.pin_memory()`): on a host without CUDA torch's C++
    refuses with a plain RuntimeError and no frame of torch's; the statement that asked names it (0.34's ShardQ
    buffers met this before the target unpinned them). The same words raised by another statement stay vLLM's."""
    import torch

    from fuzzer.errors import DeviceQueryUnanswered

    def asks():
        t = torch.zeros(4)
        return {"x": t.pin_memory(
        )}

    try:
        asks()
    except RuntimeError as e:
        refused = e
    else:
        pytest.skip("this host's torch pins memory")
    with pytest.raises(DeviceQueryUnanswered, match="pinned memory at .*t.pin_memory"):
        _Calls(asks).run(None)
    assert _Calls(_raises(RuntimeError(str(refused)))).run(None).error_type == "RuntimeError"


def test_a_platform_that_does_not_answer_is_could_not_test_not_vllm_s_answer():
    """vLLM's platform base class raises NotImplementedError for what a platform does not implement (on a GPU host
    whose vLLM detected no platform, FlashMLA's builder met it at `num_compute_units`, and two campaigns reported it
    as a finding): the host's, not the backend's. The same error raised by vLLM's own code stays its answer."""
    from vllm.platforms.interface import Platform

    from fuzzer.errors import DeviceQueryUnanswered

    with pytest.raises(DeviceQueryUnanswered, match="Platform.get_device_name: NotImplementedError"):
        _Calls(lambda: {"x": Platform.get_device_name(0)}).run(None)
    assert _Calls(_raises(NotImplementedError("vLLM refuses"))).run(None).error_type == "NotImplementedError"


def test_a_method_a_layer_lacks_in_this_release_is_could_not_test_in_a_campaign_and_a_reproducer():
    """torch.nn.Module.__getattr__ raises a layer's missing attribute: the support frame that asked for it is the one
    that raised (a method this release's layer lacks), not vLLM; a layer of vLLM's asking for its own is vLLM's."""
    import torch

    from fuzzer.artifacts.repro_harness import vllms_answer
    from fuzzer.errors import VllmCallMoved
    from fuzzer.targets.vllm_api import _ROOT

    asks = {}
    source = "def step(layer):\n    return ask(layer)\ndef ask(layer):\n    return layer._should_prepare_mqa_query\n"
    exec(compile(source, str(_ROOT / "fuzzer/support/probe.py"), "exec"), asks)
    layer = torch.nn.Linear(1, 1)
    with pytest.raises(VllmCallMoved, match="fuzzer/support/probe.py:4 .* has no attribute '_should_prepare_mqa_"):
        _Calls(lambda: asks["step"](layer)).run(None)
    exec(compile("def ask(layer):\n    return layer._should_prepare_mqa_query\n", "<attnfuzz_support: probe>", "exec"),
         asks)
    try:
        asks["ask"](layer)
    except AttributeError as e:
        assert not vllms_answer(e)
    obs = _Calls(lambda: layer.forward_of_vllm_s_own()).run(None)  # asked in this file: not attnfuzz's support code
    assert obs.error_type == "AttributeError"


def test_first_line_of_an_exception_is_empty_for_an_empty_message():
    from fuzzer.errors import first_line

    assert first_line(RuntimeError("\n  CUDA error: out of memory\nmore")) == "CUDA error: out of memory"
    assert first_line(RuntimeError()) == "" and first_line(RuntimeError("  \n")) == ""
