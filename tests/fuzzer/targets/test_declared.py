"""The registry and the declarations read without importing a target (fuzzer/targets/declared.py): what `attnfuzz
list` and `run`'s argument checks read must be what the imported classes say."""

import itertools

import pytest

from fuzzer.targets import declared as declarations
from fuzzer.targets.registry import REGISTERED, TARGETS, declared


def test_each_registered_name_is_its_class_name():
    assert list(TARGETS) == list(REGISTERED) and len(TARGETS) == len(REGISTERED)
    for name in TARGETS:
        assert TARGETS[name].name == name
    with pytest.raises(KeyError):
        TARGETS["no.such.target"]  # noqa: B018


@pytest.mark.parametrize("name", list(REGISTERED))
def test_declarations_read_from_source_are_the_classes_attributes(name):
    d, cls = declared(name), TARGETS[name]
    assert d.static, f"{name}: a declaration is not a literal on its class (fuzzer/targets/declared.py reads literals)"
    for field in declarations.FIELDS:
        got = getattr(d, field)
        want = getattr(cls, field)
        assert (tuple(want) if isinstance(got, tuple) else want) == got, field
    assert (d.module, d.cls) == (cls.__module__, cls.__name__)


def test_lineage_answers_as_issubclass_does():
    for a, b in itertools.product(REGISTERED, repeat=2):
        assert declared(a).derives_from(declared(b)) == issubclass(TARGETS[a], TARGETS[b]), (a, b)


def test_a_declaration_that_is_not_a_literal_comes_from_the_class(tmp_path, monkeypatch):
    pkg = tmp_path / "fuzzer_declared_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("class Base:\n    kv_cache_dtypes = ('bfloat16',)\n    cudagraph_modes = ('none',)\n"
                                 "    needs_vllm = True\n    cuda_gpus = 1\n")
    (pkg / "t.py").write_text("from fuzzer_declared_probe.base import Base\nPREFIX = 'made'\n\n"
                              "class T(Base):\n    name = 'probe.t'\n    summary = PREFIX + ' at import'\n"
                              "    bug_classes = 'A'\n    cuda_gpus = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(declarations, "ROOTS", (*declarations.ROOTS, "fuzzer_declared_probe"))
    d = declarations.read("fuzzer_declared_probe.t:T")
    assert not d.static and d.summary == "made at import" and d.cuda_gpus == 2 and d.kv_cache_dtypes == ("bfloat16",)
    assert d.lineage == ("fuzzer_declared_probe.t:T", "fuzzer_declared_probe.base:Base")
