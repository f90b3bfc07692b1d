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


def _index_combinations():
    from strategies.batches import IndexFeatures, index_space
    from strategies.profiles import PROFILES

    knobs = index_space(PROFILES["cpu"], IndexFeatures(block_stride_rows=True, idx_mapping=True)).knobs
    return Combinations(knobs, 1024)


def test_only_a_space_of_index_calls_pairs_call_modes():
    assert Combinations(KNOBS, 1024).mode_partners == {}
    c = _index_combinations()
    assert set(c.mode_partners) == {"plain", "valid_counts", "compaction", "prefill_workspace", "idx_mapping",
                                    "block_stride"}
    assert ("req_id_rows", "full_batch") in c.mode_partners["plain"]
    assert not {k for k, _ in c.mode_partners["plain"]} & {"valid_counts", "prefill_workspace", "idx_mapping",
                                                           "block_stride"}
    assert ("topk_width", "tile_edge") not in c.mode_partners["valid_counts"]  # it moves the case to compaction


def test_uncovered_call_mode_pairs_are_pinned_first_rarest_first_with_what_they_require():
    from strategies.case import IndexCall

    c = _index_combinations()
    reqs = (Request(1, 70), Request(5, 30))
    plain = Case(requests=reqs, num_decodes=1, block_size=64, block_table=((1, 2), (3, 0)), topk_width=256,
                 topk=(TopkSpec(40), TopkSpec(20)), call=IndexCall(token_rows="decodes")).validate()
    c.add(plain, paths=["remap"])
    assert ("plain", ("token_rows", "decodes")) in c.mode_pairs
    assert ("plain", ("req_id_rows", "full_batch")) not in c.mode_pairs
    for _ in range(12):  # no case covers anything: two batches in three steer to call-mode pairs, the third to a triple
        swarm = c.next_swarm(random.Random(0))
        pins = dict(swarm.pins)
        if pins.get("req_id_rows") == "full_batch":  # its requirements are pinned with it, not undone at random
            assert pins["token_rows"] == "decodes" and pins["decodes"] == "some" and pins["prefills"] != "none"
    # the rarest categories first (the full-batch req_id_per_token: 1/12 of an unpinned draw), for every mode
    full_batch = {m for (m, item), n in c.mode_tried.items() if item == ("req_id_rows", "full_batch") and n}
    assert full_batch == set(c.mode_partners)
    assert sum(c.tried.values()) == 4  # the triples keep their batch in three
    assert c.summary()["mode_pairs"]["total"] == c.total_mode_pairs > c.summary()["mode_pairs"]["covered"] > 0


def test_a_call_mode_pair_the_requirements_rule_out_is_given_up_at_once():
    c = _index_combinations()
    pair = ("prefill_workspace", ("prefills", "none"))  # a prefill workspace needs prefills
    assert pair in [(m, it) for m, its in c.mode_partners.items() for it in its]
    rng = random.Random(0)
    for _ in range(3 * len(c.mode_partners["prefill_workspace"])):
        pins = c.mode_pair_pins(rng)
        assert not (pins.get("prefill_workspace") == "on" and pins.get("prefills") == "none")
    assert c.mode_tried[pair] == GIVE_UP_AFTER and pair not in c.mode_pairs
