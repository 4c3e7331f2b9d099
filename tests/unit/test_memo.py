"""The bounded memos the proxy keeps its pure answers in."""

from __future__ import annotations

from egressd.proxy.core.memo import remember, remembered


def test_a_memo_computes_each_key_once() -> None:
    calls: list[str] = []

    def compute(key: str) -> int:
        calls.append(key)
        return len(key)

    memo: dict[str, int] = {}
    assert [remembered(memo, k, compute) for k in ("a", "bb", "a", "bb")] == [1, 2, 1, 2]
    assert calls == ["a", "bb"]


def test_a_full_memo_starts_again_and_never_grows_past_its_limit() -> None:
    memo: dict[int, int] = {}
    for i in range(10):
        assert remember(memo, i, i * i, limit=4) == i * i
        assert len(memo) <= 4
    assert memo == {8: 64, 9: 81}  # emptied at 4 and at 8, then refilled
