"""Combination coverage, and the swarm each batch of a campaign runs under.

Every case is read back as knob categories (strategies.swarm.case_features); the campaign counts which pairs
and triples of categories of different knobs its cases have covered, and which pairs of a vLLM path (the
coverage probes' names) with a knob category. Each batch's swarm is steered one of two ways:
- one batch in three, to a combination of knob categories no case has covered: one triple pinned whole (the
  least tried first; a combination the strategies cannot make is tried twice, then left);
- the others, to vLLM's rarest pair of paths (two paths taken together, by the fewest cases so far): the categories its
  cases share that are rare elsewhere (highest lift) are pinned, so the batch explores the region of the
  input space where vLLM's rarely combined paths meet, which is where narrow bugs live;
and each other knob is pinned, with probability PIN_SHARE, to a random category (Groce et al.'s swarm testing:
features switched off or pinned per batch).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

from strategies.swarm import Swarm, case_features, coherent

PIN_SHARE = 0.25  # a knob outside the steered triple is pinned in a quarter of the batches (more adds variance, not hits)
GIVE_UP_AFTER = 2  # batches that pinned a triple without covering it: then it is taken as infeasible
PATH_PINS = 5  # categories pinned for a rare pair of paths


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

    def next_swarm(self, rng: random.Random) -> Swarm:
        steer = self.uncovered_triple(rng) if self.swarms % 3 == 0 else None
        pins = dict(steer or ()) or self.rare_path_pins(rng)
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
            "swarms": self.swarms,
            "least_combined_knobs": [n for n, _ in sorted(seen.items(), key=lambda kv: kv[1])[:limit]],
        }

    def share(self, k: int) -> float:
        total = self.total_pairs if k == 2 else self.total_triples
        covered = len(self.pairs) if k == 2 else len(self.triples)
        return covered / total if total else 1.0
