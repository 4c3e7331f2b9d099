"""What ``egressd doctor`` says an ordinary user's ``egressd run`` would get, from what its probes found (pure)."""

from __future__ import annotations

from egressd.sandbox.rootless import Rootless


def test_with_every_part_the_sandbox_captures_everything_in_a_delegated_cgroup() -> None:
    said = Rootless(None, None, None).backend
    assert said.startswith("bubblewrap in a user and network namespace") and "every connection" in said
    assert "a delegated cgroup" in said


def test_without_nftables_in_a_user_namespace_it_is_proxy_settings_only() -> None:
    said = Rootless(None, "the kernel refuses", None).backend
    assert "proxy settings only" in said and "every connection" not in said


def test_without_a_delegated_cgroup_the_limits_are_prlimits() -> None:
    assert Rootless(None, None, "no user.slice").backend.endswith("prlimit-style limits")


def test_without_user_namespaces_an_ordinary_user_gets_nothing() -> None:
    said = Rootless("unshare failed", "untested", "untested").backend
    assert said.startswith("nothing") and "bubblewrap" not in said
