"""fuzzer/support/vllm_calls.py on plain classes: what it tells moved (CallMoved, naming the call) and what it lets
through, by the feature (signatures, where a method is defined)."""

import abc

import pytest

from fuzzer.support.errors import CallMoved
from fuzzer.support.vllm_calls import implemented, named_keywords, returned


class Base(abc.ABC):
    def __init__(self, a, q_lora_rank=None):
        self.a, self.q = a, q_lora_rank

    @abc.abstractmethod
    def forward(self): ...

    @classmethod
    def customize(cls, spec):
        return spec  # the fallback


class Impl(Base):
    def __init__(self, a, buf=None, **rest):
        super().__init__(a, **rest)

    def forward(self):
        return 1, 2

    @classmethod
    def customize(cls, spec):
        return spec + 1


class Reads(Base):
    def __init__(self, a, **rest):  # reads a keyword out of **rest by name
        super().__init__(a)
        self.rank = rest["kv_lora_rank"]

    def forward(self): ...


class Renamed(Base):
    def forward(self): ...

    @classmethod
    def customize_spec(cls, spec):  # its customize renamed: the base's fallback answers for the old name
        return spec + 1


def test_keywords_passed_on_through_kwargs_are_checked_against_the_constructor_they_reach():
    assert named_keywords(Impl, "Impl", buf=0, q_lora_rank=1) == {"buf": 0, "q_lora_rank": 1}
    assert named_keywords(Reads, "Reads", kv_lora_rank=3) == {"kv_lora_rank": 3}
    with pytest.raises(CallMoved, match=r"Impl: no parameter named q_lora_dim in this release "
                                        r"\(Impl.__init__\(\*\*rest\) takes it in\)"):
        named_keywords(Impl, "Impl", q_lora_dim=1)


def test_a_keyword_of_a_plain_function_is_checked_against_its_signature():
    def f(x, *, y=0):
        return x + y

    assert named_keywords(f, "f", y=1) == {"y": 1}
    with pytest.raises(CallMoved, match="f: no parameter named z in this release: a keyword attnfuzz passes"):
        named_keywords(f, "f", z=1)


def test_a_method_answered_by_a_base_class_fallback_is_moved():
    assert implemented(Impl, "customize", below=Base)(1) == 2
    assert implemented(Impl(0), "forward")() == (1, 2)
    with pytest.raises(CallMoved, match=r"Renamed.customize is .*Base's fallback in this release, not Renamed's own"):
        implemented(Renamed, "customize", below=Base)


def test_an_abstract_method_and_a_return_of_another_shape_are_moved():
    class Declared(Base):
        pass

    with pytest.raises(CallMoved, match="Declared.forward is only declared"):
        implemented(Declared, "forward")
    assert returned((1, 2), 2, "f") == (1, 2)
    with pytest.raises(CallMoved, match="f returned a 3-tuple, where attnfuzz takes a 2-tuple apart"):
        returned((1, 2, 3), 2, "f")
    with pytest.raises(CallMoved, match="f returned one int, where attnfuzz takes a 2-tuple apart"):
        returned(1, 2, "f")
