"""The route counters (`flashmla_runtime.record_routes`) count the tokens each route gets and leave the impl to
reference counting: they shadow its methods on the impl itself, so they may not hold it back (a case's impl, with
what it holds, would wait for Python's cyclic collector)."""

import gc
import weakref

import pytest

pytestmark = pytest.mark.vllm


def test_the_route_counters_count_and_leave_the_impl_to_reference_counting():
    import torch

    from fuzzer.support.flashmla_runtime import record_routes

    class Impl:
        def forward_mqa(self, q, *args, **kwargs):
            return "mqa", q.shape[0]

        def forward_mha(self, q, *args, **kwargs):
            return "mha", q.shape[0]

    impl, route = Impl(), {}
    record_routes(impl, route)
    assert impl.forward_mqa(torch.zeros(3, 2)) == ("mqa", 3) and impl.forward_mha(torch.zeros(5, 2)) == ("mha", 5)
    assert route == {"mqa_tokens": 3, "mha_tokens": 5}
    held = weakref.ref(impl)
    gc.disable()
    try:
        del impl
        assert held() is None
    finally:
        gc.enable()
