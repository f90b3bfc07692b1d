"""Combination coverage counts pairs and triples of knob categories; the next swarm steers to an uncovered one."""

import itertools
import random

from fuzzer.search.combinations import GIVE_UP_AFTER, Combinations
from strategies.case import Case, Request, TopkSpec

KNOBS = {"decodes": ("none", "some"), "kv_cache_dtype": ("bfloat16", "fp8_ds_mla"), "values": ("normal", "large", "tiny"),
         "heads": ("16",)}


def case(**kw) -> Case:
    return Case(requests=(Request(1, 10),), num_decodes=1, block_size=64, block_table=((1,),), topk_width=128,
                topk=(TopkSpec(5),), **kw)


def test_totals_count_every_combination_of_categories_of_different_knobs():
    c = Combinations(KNOBS, 1024)
    assert "heads" not in c.knobs  # one category: it combines with nothing
    sizes = [2, 2, 3]
    assert c.total_pairs == sum(a * b for a, b in itertools.combinations(sizes, 2)) == 16
    assert c.total_triples == 12


def test_a_case_covers_its_pairs_and_triples_and_the_swarm_steers_to_what_is_left():
    c = Combinations(KNOBS, 1024)
    features = c.add(case(kv_cache_dtype="fp8_ds_mla", values="tiny"), paths=["flashmla.fp8"])
    assert features == {"decodes": {"some"}, "kv_cache_dtype": {"fp8_ds_mla"}, "values": {"tiny"}}
    assert len(c.pairs) == 3 and len(c.triples) == 1 and len(c.path_pairs) == 3
    assert c.categories[("values", "tiny")] == 1
    rng = random.Random(0)
    steered = c.uncovered_triple(rng)
    assert steered is not None and steered not in c.triples
    swarm = c.next_swarm(random.Random(1))
    assert c.swarms == 1 and sum(c.tried.values()) == 1
    pinned = dict(swarm.pins)
    (t, _), = c.tried.items()
    assert all(pinned[k] == v for k, v in t)  # the steered triple is pinned whole


def test_a_triple_pinned_in_vain_is_given_up():
    c = Combinations(KNOBS, 1024)
    for _ in range(3 * GIVE_UP_AFTER * c.total_triples):  # one batch in three steers to a triple
        c.next_swarm(random.Random(0))
    assert c.uncovered_triple(random.Random(0)) is None
    summary = c.summary()
    assert summary["triples"] == {"covered": 0, "total": 12} and summary["swarms"] == 3 * GIVE_UP_AFTER * 12


def test_the_rarest_pair_of_paths_pins_what_its_cases_share_and_the_others_lack():
    c = Combinations(KNOBS, 1024)
    for values in ("normal", "large", "tiny", "normal"):
        c.add(case(kv_cache_dtype="bfloat16", values=values), paths=["mqa", "bf16"])
    c.add(case(kv_cache_dtype="fp8_ds_mla", values="tiny"), paths=["mqa", "fp8.separate_prefill_decode"])
    assert c.path_combos[("fp8.separate_prefill_decode", "mqa")] == 1
    pins = c.rare_path_pins(random.Random(0))
    assert pins == {"kv_cache_dtype": "fp8_ds_mla", "values": "tiny"}  # decodes=some is in every case: no lift
    swarm = c.next_swarm(random.Random(0)) and c.next_swarm(random.Random(0))  # the second batch steers to paths
    assert dict(swarm.pins)["kv_cache_dtype"] == "fp8_ds_mla"
