"""Upload budgets, pure: what a connection may send, and what the owner lends a worker (``--workers``)."""

from __future__ import annotations

from egressd.proxy.core.budget import Budget, lend


def test_short_says_how_far_past_the_budget_a_send_would_go() -> None:
    budget = Budget("example.com", 100)
    assert budget.short(100) == 0
    budget.spend(60)
    assert (budget.short(40), budget.short(41)) == (0, 1)


def test_an_allow_grants_another_budget_from_what_was_sent_and_what_is_about_to_be() -> None:
    budget = Budget("example.com", 100)
    budget.spend(100)
    budget.granted(30)
    assert budget.limit == 230


def test_a_loan_is_a_share_while_the_budget_has_it_and_never_more_than_is_left() -> None:
    owner = Budget("example.com", 1000)
    assert lend(owner, 1, 300) == 300
    assert lend(owner, 500, 300) == 500  # a need larger than a share is lent whole
    assert lend(owner, 1, 300) == 200  # what is left
    assert owner.sent == owner.limit == 1000
    assert lend(owner, 1, 300) is None  # spent: a person is asked


def test_a_need_past_what_is_left_lends_nothing() -> None:
    owner = Budget("example.com", 1000)
    owner.spend(900)
    assert lend(owner, 101, 50) is None
    assert owner.sent == 900


def test_a_workers_budget_starts_at_nothing() -> None:
    budget = Budget("example.com", 1000, limit=0)
    assert budget.short(1) == 1 and budget.over_or_at
