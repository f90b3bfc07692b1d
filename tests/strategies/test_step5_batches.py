"""Step5 DSA cases read back as the knob categories they were drawn under (the gate's pair coverage counts them)."""

from strategies.profiles import PROFILES
from strategies.step5_batches import step5_space
from strategies.swarm import case_features
from tests.strategies import drawn

P = PROFILES["cpu"]
SPACE = step5_space(P)
# Categories another knob or the profile may undo: a permuted table of one block reads as arange, a request's
# context is drawn within a range that meets the next category's, the first request's last token may land on a
# region edge when "any" is pinned, an fp8 page too small for the tail ring is widened to 32-token blocks.
LOOSE = {"table_layout", "table_last_column", "step5_context", "step5_region_edge", "block_size"}


def draw_cases(swarm, n=12):
    return drawn.draw_cases(SPACE, swarm, n, 5)


def test_every_knob_of_the_space_is_read_back_from_a_case():
    for case in draw_cases(None, 20):
        assert set(case_features(case, SPACE.knobs, P.max_context)) == set(SPACE.knobs)


def test_a_pinned_category_shows_in_the_cases():
    for name, value, features in drawn.pinned_features(SPACE, draw_cases, P.max_context):
        share = drawn.share(value, [f[name] for f in features])  # every case of the space has every knob
        assert share >= (0.3 if name in LOOSE else 0.9), (name, value, share)
