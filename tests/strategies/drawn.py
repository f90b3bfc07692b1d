"""What the strategy tests share: cases drawn from a space under a swarm, and the features of the cases drawn under
each category a swarm can pin."""

import random

from hypothesis import HealthCheck, given, seed, settings

from strategies.swarm import case_features, coherent


def draw_cases(space, swarm, n, at_seed):
    """N cases of SPACE drawn under SWARM (None: no swarm), the same ones every time (hypothesis seed AT_SEED)."""
    cases = []

    @seed(at_seed)
    @settings(max_examples=n, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(space.strategy(swarm))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def pinned_features(space, draw, max_context):
    """For each knob value of SPACE that a coherent swarm pins (with what it requires; a value whose requirement cannot
    hold in this space is passed over): (knob, value, the features of the cases DRAW(swarm) gives)."""
    for name, values in space.knobs.items():
        for value in values:
            swarm = coherent({name: value}, space.knobs, random.Random(0), keep={name})
            if swarm.pinned(name) != value:
                continue
            yield name, value, [case_features(c, space.knobs, max_context) for c in draw(swarm)]


def share(value, seen) -> float:
    """The share of SEEN (each a case's categories of one knob) that shows VALUE; 0 where nothing was seen."""
    return sum(value in s for s in seen) / max(1, len(seen))
