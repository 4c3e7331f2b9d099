"""bench/targets.py: issue 30's targets judged from measured medians, and the audit writes counted from strace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "targets.py"
_spec = importlib.util.spec_from_file_location("bench_targets", _PATH)
assert _spec is not None and _spec.loader is not None
targets = importlib.util.module_from_spec(_spec)
sys.modules["bench_targets"] = targets  # dataclasses look their module up by name
_spec.loader.exec_module(targets)

SETUP = targets.Target("tunnel setup", "tunnels/s", "setup_serial", "squid", 1.2)
CPU = targets.Target("CPU per tunnel", "µs", "cpu_per_tunnel_us", "squid", 1.0, higher=False)
IDLE = targets.Target("idle memory", "KiB", "idle_kib", targets.LIMIT, 1.0, higher=False, limit=5.0)
WORKERS = targets.Target("workers", "req/s", "http_small_w2", "egressd", 1.7, versus_figure="http_small_w1")


def one(target, medians, reasons=None):
    [row] = targets.evaluate(medians, reasons, (target,))
    return row


def test_a_figure_that_meets_its_target():
    row = one(SETUP, {"egressd": {"setup_serial": 3900.0}, "squid": {"setup_serial": 3000.0}})
    assert row.verdict == "met"
    assert row.ratio == pytest.approx(1.3)
    assert (row.ours, row.theirs) == (3900.0, 3000.0)


def test_a_figure_that_misses_its_target():
    row = one(SETUP, {"egressd": {"setup_serial": 2244.0}, "squid": {"setup_serial": 3208.0}})
    assert row.verdict == "not met"
    assert row.ratio == pytest.approx(2244 / 3208)


def test_exactly_the_bound_is_met():
    row = one(SETUP, {"egressd": {"setup_serial": 120.0}, "squid": {"setup_serial": 100.0}})
    assert row.verdict == "met"


def test_a_missing_peer_is_not_measured_and_says_why():
    row = one(SETUP, {"egressd": {"setup_serial": 3900.0}})
    assert row.verdict == "not measured: no squid figure"
    assert row.ratio is None and row.ours == 3900.0
    said = one(SETUP, {"egressd": {"setup_serial": 3900.0}}, {"squid": "squid not in --proxies"})
    assert said.verdict == "not measured: squid not in --proxies"


def test_a_missing_egressd_figure_is_not_measured_with_its_reason():
    row = one(WORKERS, {"egressd": {"http_small": 5000.0}}, {"http_small_w2": "no --workers"})
    assert row.verdict == "not measured: no --workers"


def test_nan_counts_as_missing():
    row = one(SETUP, {"egressd": {"setup_serial": float("nan")}, "squid": {"setup_serial": 3000.0}})
    assert row.verdict.startswith("not measured")


def test_lower_is_better_targets_compare_the_other_way():
    assert one(CPU, {"egressd": {"cpu_per_tunnel_us": 200.0}, "squid": {"cpu_per_tunnel_us": 225.0}}).met
    assert not one(CPU, {"egressd": {"cpu_per_tunnel_us": 340.0}, "squid": {"cpu_per_tunnel_us": 225.0}}).met


def test_a_fixed_limit_needs_no_peer():
    assert one(IDLE, {"egressd": {"idle_kib": 4.3}}).met
    row = one(IDLE, {"egressd": {"idle_kib": 6.0}})
    assert row.verdict == "not met" and row.theirs == 5.0


def test_egressd_against_another_of_its_figures():
    row = one(WORKERS, {"egressd": {"http_small_w1": 5000.0, "http_small_w2": 9000.0}})
    assert row.verdict == "met" and row.ratio == pytest.approx(1.8)


def test_a_zero_comparison_is_not_a_ratio():
    row = one(SETUP, {"egressd": {"setup_serial": 1.0}, "squid": {"setup_serial": 0.0}})
    assert row.verdict.startswith("not measured")


def test_every_issue_target_has_a_row_and_the_table_says_each_verdict():
    # Issue 30's first row: the proxy's CPU per tunnel, ≤ 1.3× squid's now, ≤ squid's as the goal.
    rows = targets.evaluate({"egressd": {"cpu_per_tunnel_us": 390.0}, "squid": {"cpu_per_tunnel_us": 300.0}})
    assert len(rows) == len(targets.TARGETS)
    text = targets.render(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows) + 1
    assert "| met" in lines[2] and "1.30×" in lines[2] and "≤ 1.30×" in lines[2] and "≤ 1.00×" in lines[2]
    assert "not measured: no egressd figure" in text
    assert lines[-1] == f"targets met: 1 of {len(rows)} (1 measured)"


TRACE = """\
101 epoll_wait(3<anon_inode:[eventpoll]>, [], 1024, 0) = 0
101 write(9</tmp/b/audit.jsonl>, ""..., 600) = 600
101 write(12<TCP:[127.0.0.1:3128->127.0.0.1:5000]>, ""..., 39) = 39
101 epoll_wait(3<anon_inode:[eventpoll]>, [{events=EPOLLIN}], 1024, -1) = 1
101 write(9</tmp/b/audit.jsonl>, ""..., 300) = 300
101 writev(9</tmp/b/audit.jsonl>, [...], 2 <unfinished ...>
102 write(5<pipe:[1]>, ""..., 8) = 8
101 <... writev resumed>) = 300
101 epoll_pwait(3<anon_inode:[eventpoll]>, [], 1024, 0, NULL, 8) = 0
101 epoll_wait(3<anon_inode:[eventpoll]>, [], 1024, 0) = 0
101 write(9</tmp/b/audit.jsonl>, ""..., 300) = 300
"""


def test_audit_writes_are_counted_per_loop_turn():
    counted = targets.audit_writes(TRACE, "/tmp/b/audit.jsonl")
    assert counted == targets.AuditWrites(writes=4, turns=4, turns_with_writes=3, max_per_turn=2)


def test_no_audit_writes_in_a_trace():
    counted = targets.audit_writes("7 epoll_wait(3, [], 1024, 0) = 0\n", "/tmp/b/audit.jsonl")
    assert counted == targets.AuditWrites(writes=0, turns=1, turns_with_writes=0, max_per_turn=0)


DNS = """\
DNS on loopback, UDP, A queries, 64 in flight, 2 CPUs, Python 3.11.7, x86_64
server                                         answered   lost  seconds  queries/s
dnsmasq 2.90                                      81936      0     2.00      40968
egressd (uvloop, 12345 audit records)             12086      0     2.00       6043
egressd / dnsmasq: 0.15
"""


DNS_WITH_COSTS = """\
DNS on loopback, UDP, A queries, 64 in flight, 2 CPUs, Python 3.11.7, x86_64
server                                         answered   lost  seconds  queries/s  CPU µs/q  writes/q
dnsmasq 2.90                                     252928      0     2.00     126256       7.6     0.000
egressd (uvloop, 62530 audit records)             41984      0     2.00      20942      46.9     0.032
egressd / dnsmasq: 0.17
"""


def test_dns_rates_are_read_from_bench_dns_table():
    assert targets.parse_dns(DNS) == {"dnsmasq": 40968.0, "egressd": 6043.0}
    assert targets.parse_dns(DNS_WITH_COSTS) == {"dnsmasq": 126256.0, "egressd": 20942.0}
    assert targets.parse_dns("note: dnsmasq is not installed\n") == {}
