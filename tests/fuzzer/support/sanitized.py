"""What the stand-in tests share: the memory violations the interpreter's sanitizer records during a call or a test,
taken out of its list so that no other test sees them."""

import pytest

from fuzzer.support.interp.sanitizer import SANITIZER


def violations_during(call):
    """CALL(), and the violations recorded while it ran (dropped from SANITIZER's list): (its result, them)."""
    before = len(SANITIZER.violations)
    result = call()
    found = SANITIZER.violations[before:]
    del SANITIZER.violations[before:]
    return result, found


@pytest.fixture
def violations():
    """Where this test's violations start in SANITIZER's list; they are dropped after it."""
    before = len(SANITIZER.violations)
    yield before
    del SANITIZER.violations[before:]
