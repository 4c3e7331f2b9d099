"""Benchmark figures live in one place, bench/RESULTS.md; the README and docs/ link to it (issue 16).

The README once gave DNS as "about 10,600 q/s, 0.08×" and, elsewhere,
"21,300–28,300, 0.19–0.24×": two copies of a figure drift apart. A rate (q/s,
queries/s, requests/s, tunnels/s, MB/s, GB/s) or a ratio (0.60×, 1.3x) in the
README or a page of docs/ fails here; write it in bench/RESULTS.md and link there.
"""

from __future__ import annotations

import re

from tests import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
RESULTS = REPO / "bench" / "RESULTS.md"

_NUMBER = r"\d[\d,.]*(?:[–-]\d[\d,.]*)?"
# A rate: a number and a per-second unit of throughput ("10,600 UDP queries a second" too).
_RATE = re.compile(
    rf"{_NUMBER}\s*(?:q/s|queries/s|req/s|requests/s|tunnels/s|[KMG]i?B/s"
    r"|(?:[A-Za-z]+\s+)?(?:queries|requests|tunnels)\s+(?:a|per)\s+second)",
    re.IGNORECASE,
)
# A ratio: a number directly followed by × or x (not a size such as 80×24), or "a ratio of 0.08".
_RATIO = re.compile(rf"(?<![\w.]){_NUMBER}\s?[×x](?![\w×])|ratio of {_NUMBER}")
# Design bounds, not measurements: the DNS rate limit, and what it lets into the log at most.
ALLOWED = {("docs/dns.md", "40 KB/s"), ("docs/dns.md", "100 queries a second")}


def figures(text: str) -> list[str]:
    return [m.group(0) for pattern in (_RATE, _RATIO) for m in pattern.finditer(text)]


def test_the_scan_finds_the_figures_that_once_contradicted_each_other() -> None:
    assert figures("about 10,600 q/s, 0.08× dnsmasq") == ["10,600 q/s", "0.08×"]
    assert figures("egressd answered 21,300–28,300 queries/s, 0.19–0.24×") == ["21,300–28,300 queries/s", "0.19–0.24×"]
    assert figures("3824 MB/s down; 1.3x the best peer") == ["3824 MB/s", "1.3x"]
    assert figures("about 10,600 UDP queries a second: a ratio of 0.08") == [
        "10,600 UDP queries a second", "ratio of 0.08",
    ]  # fmt: skip
    assert figures("an 80×24 terminal, allowed pypi.org:443 ×2, 0x1F, fix bugs") == []
    assert figures(RESULTS.read_text(encoding="utf-8")), "the results themselves are scanned as a check of the scan"


def test_no_page_but_the_results_gives_a_figure() -> None:
    found = []
    for page in PAGES:
        name = page.relative_to(REPO).as_posix()
        text = " ".join(page.read_text(encoding="utf-8").split())  # a figure broken over two lines is one
        found += [f"{name}: {f}" for f in figures(text) if (name, f) not in ALLOWED]
    assert found == [], "figures belong in bench/RESULTS.md only; link to it instead"


def test_the_pages_that_spoke_of_figures_link_to_the_results() -> None:
    for page in ("README.md", "docs/performance.md", "docs/dns.md"):
        assert "bench/RESULTS.md" in (REPO / page).read_text(encoding="utf-8"), page
