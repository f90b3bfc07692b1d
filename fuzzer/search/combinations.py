"""Combination coverage, and the swarm each batch of a campaign runs under.

Every case is read back as knob categories (strategies.swarm.case_features); the campaign counts which pairs
and triples of categories of different knobs its cases have covered, and which pairs of a vLLM path (the
coverage probes' names) with a knob category. In a space of index-remap calls it also counts the pairs of a call
mode of the remap (strategies.swarm.call_modes: plain, valid counts, compaction, prefill workspace, idx_mapping,
block stride) with each category of the other knobs: a bug in one call mode shows only where its mode meets what
else it needs (the full-batch req_id_per_token), and left to chance a mode drawn in one case in sixteen (plain)
meets a category drawn in one in twelve within 300 cases, or does not. Each batch's swarm is steered one of three
ways:
- one batch in three, to a combination of knob categories no case has covered: one triple pinned whole (the
  least tried first; a combination the strategies cannot make is tried twice, then left);
- the others, while any is left, to call-mode pairs no case has covered: the mode's knobs pinned with the category
  of the pair chance is slowest to make (the least share of an unpinned draw, requirements included:
  strategies.swarm.category_share), and up to MODE_PARTNERS - 1 more of that mode's, with what they require; a pair
  the requirements rule out is left at once, one the strategies cannot make after GIVE_UP_AFTER batches (in a
  campaign that finds nothing, the first 300-370 cases of an index-remap campaign on the CPU profile);
- after that, to vLLM's rarest pair of paths (two paths taken together, by the fewest cases so far): the categories its
  cases share that are rare elsewhere (highest lift) are pinned, so the batch explores the region of the
  input space where vLLM's rarely combined paths meet, which is where narrow bugs live;
and each other knob is pinned, with probability PIN_SHARE, to a random category (Groce et al.'s swarm testing:
features switched off or pinned per batch).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

from strategies.swarm import (
    CALL_MODES,
    Swarm,
    call_mode_partners,
    call_mode_pins,
    call_modes,
    case_features,
    category_share,
    coherent,
)

PIN_SHARE = 0.25  # a knob outside the steered triple is pinned in a quarter of the batches (more adds variance, not hits)
GIVE_UP_AFTER = 2  # batches that pinned a triple without covering it: then it is taken as infeasible
PATH_PINS = 5  # categories pinned for a rare pair of paths
MODE_PARTNERS = 3  # uncovered categories pinned with a call mode in one batch


def _esp(sizes: list[int], k: int) -> int:
    """Sum over k-subsets of the product of sizes (the number of k-way combinations of categories)."""
    e = [1] + [0] * k
    for s in sizes:
        for j in range(k, 0, -1):
            e[j] += e[j - 1] * s
    return e[k]


class Combinations:
    def __init__(self, knobs: dict[str, tuple[str, ...]], max_context: int) -> None:
        self.max_context = max_context
        self.knobs = {n: v for n, v in knobs.items() if len(v) > 1}  # a knob of one category combines with nothing
        self.pairs: set[tuple] = set()
        self.triples: set[tuple] = set()
        self.path_pairs: set[tuple] = set()
        self.categories: Counter = Counter()  # (knob, category) -> cases that took it
        self.cases = 0
        self.path_combos: Counter = Counter()  # a pair of paths (or a path alone) -> cases that took it
        self.path_categories: dict[tuple, Counter] = {}  # the same -> (knob, category) -> cases
        self.tried: Counter = Counter()  # steered triple -> batches that pinned it
        self.swarms = 0
        # The index remap's call modes this space draws (a space of index calls turns valid_counts), each with the
        # categories it pairs with; (mode, (knob, category)) pairs covered, modes' cases, and pairs steered to.
        index = "valid_counts" in self.knobs
        self.mode_partners = {m: call_mode_partners(m, self.knobs) for m in CALL_MODES
                              if index and call_mode_pins(m, self.knobs) is not None}
        self.mode_pairs: set[tuple] = set()
        self.mode_cases: Counter = Counter()
        self.mode_tried: Counter = Counter()
        self.shares = {(n, v): category_share(n, v, self.knobs) for n, vs in self.knobs.items() for v in vs}

    @property
    def total_pairs(self) -> int:
        return _esp([len(v) for v in self.knobs.values()], 2)

    @property
    def total_triples(self) -> int:
        return _esp([len(v) for v in self.knobs.values()], 3)

    def add(self, case, paths) -> dict[str, frozenset[str]]:
        """Count `case` (and the vLLM paths it took); returns its knob categories."""
        features = case_features(case, self.knobs, self.max_context)
        items = sorted((n, v) for n, vs in features.items() for v in vs if n in self.knobs)
        self.categories.update(items)
        for a, b in itertools.combinations(items, 2):
            if a[0] != b[0]:
                self.pairs.add((a, b))
        for t in itertools.combinations(items, 3):
            if t[0][0] != t[1][0] != t[2][0] != t[0][0]:
                self.triples.add(t)
        for p in paths:
            self.path_pairs.update((p, it) for it in items)
        if self.mode_partners:
            for mode in call_modes(case) & self.mode_partners.keys():
                self.mode_cases[mode] += 1
                self.mode_pairs.update((mode, it) for it in items)
        self.cases += 1
        paths = sorted(set(paths))
        for key in [(p,) for p in paths] + list(itertools.combinations(paths, 2)):
            self.path_combos[key] += 1
            self.path_categories.setdefault(key, Counter()).update(items)
        return features

    def rare_path_pins(self, rng: random.Random) -> dict[str, str]:
        """Pins for the region of vLLM's rarest pair of paths (or path): the categories most of its cases share,
        by lift over their share in all cases."""
        if not self.path_combos:
            return {}
        least = min(self.path_combos.values())
        key = rng.choice(sorted(k for k, n in self.path_combos.items() if n == least))
        n, cats = self.path_combos[key], self.path_categories[key]
        lift = {c: (k / n) / (self.categories[c] / self.cases) for c, k in cats.items() if k >= 0.8 * n}
        pins: dict[str, str] = {}
        for (name, value), _ in sorted(lift.items(), key=lambda kv: (-kv[1], kv[0])):
            if name not in pins and lift[(name, value)] > 1.0:
                pins[name] = value
            if len(pins) == PATH_PINS:
                break
        return pins

    def uncovered_triple(self, rng: random.Random) -> tuple | None:
        best, least = [], GIVE_UP_AFTER
        for names in itertools.combinations(sorted(self.knobs), 3):
            for values in itertools.product(*(self.knobs[n] for n in names)):
                t = tuple(zip(names, values))
                if t in self.triples:
                    continue
                n = self.tried[t]
                if n >= GIVE_UP_AFTER:
                    continue
                if n < least:
                    best, least = [t], n
                elif n == least:
                    best.append(t)
        return rng.choice(best) if best else None

    @property
    def total_mode_pairs(self) -> int:
        return sum(len(p) for p in self.mode_partners.values())

    def _rarity(self, item: tuple[str, str]) -> tuple[float, int]:
        """What chance is slowest to make first: the category's share of an unpinned draw (its requirements
        included: strategies.swarm.category_share), then the fewest cases so far."""
        return self.shares[item], self.categories[item]

    def uncovered_mode_pairs(self, mode: str) -> list[tuple]:
        """`mode`'s pairs no case has covered and not given up, the least tried first, then the rarest category."""
        left = [(mode, it) for it in self.mode_partners[mode]
                if (mode, it) not in self.mode_pairs and self.mode_tried[(mode, it)] < GIVE_UP_AFTER]
        return sorted(left, key=lambda p: (self.mode_tried[p], *self._rarity(p[1]), p))

    def uncovered_mode_pair(self, rng: random.Random) -> tuple | None:
        """A (call mode, (knob, category)) pair no case has covered: the least tried, then the category chance is
        slowest to make, then of the mode with the most such pairs left (a batch of it covers the most), then the
        category the fewest cases took."""
        left = {m: self.uncovered_mode_pairs(m) for m in self.mode_partners}
        keyed = [((self.mode_tried[p], self.shares[p[1]], -len(ps), self.categories[p[1]]), p)
                 for ps in left.values() for p in ps]
        if not keyed:
            return None
        least = min(k for k, _ in keyed)
        return rng.choice([p for k, p in keyed if k == least])

    def _held(self, pins: dict[str, str], rng: random.Random) -> dict[str, str] | None:
        """`pins` with what they require pinned too (strategies.swarm.REQUIRES), or None where the requirements
        undo one of them."""
        held = coherent(pins, self.knobs, rng, keep=set(pins))
        return dict(held.pins) if all(held.pinned(k) == v for k, v in pins.items()) else None

    def mode_pair_pins(self, rng: random.Random) -> dict[str, str]:
        """Pins for uncovered call-mode pairs a swarm can hold: the mode's knobs, the category of one pair, and those
        of up to MODE_PARTNERS - 1 more of the same mode (other knobs, rarest first) that hold with them, with what
        they require (the full-batch req_id_per_token: decode rows passed, decodes, prefills), so that no pin drawn
        at random undoes them; {} when none is left. A pair whose pins the requirements undo (a prefill workspace
        without prefills) is given up."""
        while (pair := self.uncovered_mode_pair(rng)) is not None:
            mode, (name, value) = pair
            pins = {**call_mode_pins(mode, self.knobs), name: value}
            held = self._held(pins, rng)
            if held is None:
                self.mode_tried[pair] = GIVE_UP_AFTER
                continue
            steered = [pair]
            for other in self.uncovered_mode_pairs(mode):
                if len(steered) == MODE_PARTNERS:
                    break
                k, v = other[1]
                more = self._held({**pins, k: v}, rng) if k not in held else None
                if more is not None:
                    pins[k], held = v, more
                    steered.append(other)
            self.mode_tried.update(steered)
            return held
        return {}

    def next_swarm(self, rng: random.Random) -> Swarm:
        steer = self.uncovered_triple(rng) if self.swarms % 3 == 0 else None
        pins = dict(steer or ()) or (self.mode_pair_pins(rng) if self.mode_partners else {}) or self.rare_path_pins(rng)
        steered = set(pins)
        for name, values in self.knobs.items():
            if name not in pins and rng.random() < PIN_SHARE:
                pins[name] = rng.choice(values)
        swarm = coherent(pins, self.knobs, rng, keep=steered)
        if steer:
            self.tried[steer] += 1
        self.swarms += 1
        return swarm

    def summary(self, limit: int = 12) -> dict:
        """What campaign.json and the report show: covered of possible (impossible combinations included)."""
        seen = Counter(n for t in self.pairs for n, _ in t)
        return {
            "knobs": {n: {v: self.categories[(n, v)] for v in vs} for n, vs in self.knobs.items()},
            "pairs": {"covered": len(self.pairs), "total": self.total_pairs},
            "triples": {"covered": len(self.triples), "total": self.total_triples},
            "path_pairs": len(self.path_pairs),
            "mode_pairs": {"covered": sum((m, it) in self.mode_pairs for m, its in self.mode_partners.items()
                                          for it in its), "total": self.total_mode_pairs},
            "swarms": self.swarms,
            "least_combined_knobs": [n for n, _ in sorted(seen.items(), key=lambda kv: kv[1])[:limit]],
        }

    def share(self, k: int) -> float:
        total = self.total_pairs if k == 2 else self.total_triples
        covered = len(self.pairs) if k == 2 else len(self.triples)
        return covered / total if total else 1.0
