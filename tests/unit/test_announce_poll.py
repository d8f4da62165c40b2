"""The armed receiver's wait for the source's announcement (transports/collective.py): few store checks long
before the expected time, and the announcement seen within about a millisecond around it."""

import threading
import time
import types

from transports.collective import ANNOUNCE_POLL_FINE_S, WeightSyncGroup


class Store:
    def __init__(self, at: float) -> None:
        self.at, self.checks = at, 0

    def check(self, keys):
        self.checks += 1
        return time.monotonic() >= self.at


def _group(store: Store, expected: float | None):
    return types.SimpleNamespace(_announce=store, _pg=object(), timeout_s=30.0, rank=1, _broken=None,
                                 _armed_wait_s=expected, _lock=threading.Lock())


def test_an_armed_wait_checks_rarely_before_the_expected_time_and_finely_around_it():
    t0 = time.monotonic()
    store = Store(t0 + 0.2)
    group = _group(store, expected=0.2)
    WeightSyncGroup._announce_wait(group, 0, armed=True)
    late = time.monotonic() - store.at
    assert late < ANNOUNCE_POLL_FINE_S + 0.004  # seen within ~1 ms (plus the sleep's own slack)
    assert store.checks < 45  # 18 coarse checks up to 0.18 s, then about 20 fine ones: not 400
    assert abs(group._armed_wait_s - 0.2) < 0.01  # the next wait expects what this one took


def test_a_wait_far_later_than_expected_slows_down_to_the_coarse_pace():
    t0 = time.monotonic()
    store = Store(t0 + 0.5)
    group = _group(store, expected=0.05)
    WeightSyncGroup._announce_wait(group, 0, armed=True)
    assert store.checks < 120  # 1 ms checks for 0.07 s, then 10 ms ones: not 500
    assert group._armed_wait_s >= 0.5
