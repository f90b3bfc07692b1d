"""Step5 DSA cases read back as the knob categories they were drawn under (the gate's pair coverage counts them)."""

import random

from hypothesis import HealthCheck, given, seed, settings

from strategies.profiles import PROFILES
from strategies.step5_batches import step5_space
from strategies.swarm import case_features, coherent

P = PROFILES["cpu"]
SPACE = step5_space(P)
# Categories another knob or the profile may undo: a permuted table of one block reads as arange, a request's
# context is drawn within a range that meets the next category's, the first request's last token may land on a
# region edge when "any" is pinned, an fp8 page too small for the tail ring is widened to 32-token blocks.
LOOSE = {"table_layout", "table_last_column", "step5_context", "step5_region_edge", "block_size"}


def draw_cases(swarm, n=12):
    cases = []

    @seed(5)
    @settings(max_examples=n, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(SPACE.strategy(swarm))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def test_every_knob_of_the_space_is_read_back_from_a_case():
    for case in draw_cases(None, 20):
        assert set(case_features(case, SPACE.knobs, P.max_context)) == set(SPACE.knobs)


def test_a_pinned_category_shows_in_the_cases():
    for name, values in SPACE.knobs.items():
        for value in values:
            swarm = coherent({name: value}, SPACE.knobs, random.Random(0), keep={name})
            if swarm.pinned(name) != value:
                continue
            seen = [case_features(c, SPACE.knobs, P.max_context)[name] for c in draw_cases(swarm)]
            share = sum(value in s for s in seen) / len(seen)
            assert share >= (0.3 if name in LOOSE else 0.9), (name, value, share)
