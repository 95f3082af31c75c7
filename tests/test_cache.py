"""``_util.cache.remember``: the bound holds and nothing raises, however many threads write."""

from __future__ import annotations

import sys
import threading

import pytest

from functional_fp16._util.cache import remember

THREADS = 6
KEPT = 5


def test_remember_keeps_the_newest_entries_within_the_bound():
    table: dict = {}
    for i in range(10):
        assert remember(table, i, str(i), 3) == str(i)
    assert table == {7: "7", 8: "8", 9: "9"}
    remember(table, 8, "eight", 3)  # a known key: replaced where it is, nothing evicted
    assert table == {7: "7", 8: "eight", 9: "9"}
    with pytest.raises(ValueError, match="at least 1"):
        remember(table, 10, "10", 0)


def test_remember_from_many_threads_raises_nothing_and_keeps_the_bound():
    table: dict = {}
    errors: list[BaseException] = []
    largest = [0]
    start = threading.Barrier(THREADS)

    def work(thread: int) -> None:
        try:
            start.wait()
            for i in range(100_000):
                key = (thread, i % 37)
                assert remember(table, key, i, KEPT) == i
                table.get((thread - 1, i % 37))  # a reader without the lock
                largest[0] = max(largest[0], len(table))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch every few bytecodes
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert largest[0] <= KEPT
    assert len(table) <= KEPT
