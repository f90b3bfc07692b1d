import random

from fuzzer.artifacts.repro import compact_list


def test_compact_list_is_exact_and_short():
    rng = random.Random(0)
    for _ in range(200):
        xs = []
        for _ in range(rng.randint(0, 6)):
            kind = rng.choice(["run", "range", "noise"])
            n = rng.randint(1, 40)
            xs += [-1] * n if kind == "run" else list(range(n, 2 * n)) if kind == "range" else [rng.randint(-1, 99) for _ in range(n % 5)]
        assert eval(compact_list(xs)) == xs
    assert compact_list([-1] * 128) == "[-1] * 128"
    assert compact_list([3, 4, 5, 6, 7, -1, -1]) == "list(range(3, 8)) + [-1, -1]"
