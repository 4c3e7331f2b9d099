"""The fuzz targets, briefly and with fixed seeds, so CI runs them on every change; and proof the loop is guided."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from egressd.proxy.core import runs
from egressd.proxy.core.http1.framing import ChunkedScanner
from tests.fuzz import fuzz_parsers, toy_parser
from tests.fuzz.fuzz_parsers import (
    TARGETS,
    TOY,
    FuzzFailure,
    check_chunked,
    check_clienthello,
    check_proxy_auth,
    fuzz,
    main,
    reference_chunked,
)
from tests.harness import require

# Inputs per target and seed: about a second each on a slow machine.
BUDGET = {"http_head": 3000, "chunked": 600, "clienthello": 2000, "dns": 2000, "proxy_auth": 3000}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_target_finds_nothing(target: str, seed: int) -> None:
    stats = fuzz(target, seed=seed, iterations=BUDGET[target])
    assert stats.executions == BUDGET[target]
    assert stats.lines > 0 and len(stats.corpus) >= len(TARGETS[target].seeds())


def test_the_guided_loop_finds_a_bug_behind_five_bytes_that_blind_mutation_does_not() -> None:
    with pytest.raises(FuzzFailure, match="IndexError"):
        fuzz(TOY, seed=1, iterations=60_000)
    blind = fuzz(TOY, seed=1, iterations=60_000, guided=False)
    assert blind.executions == 60_000  # no failure: five bytes at once are out of its reach


def test_the_guided_loop_covers_more_of_http1_than_blind_mutation_with_the_same_inputs() -> None:
    guided = fuzz("http_head", seed=1, iterations=3000)
    blind = fuzz("http_head", seed=1, iterations=3000, guided=False)
    assert len(guided.edges) > len(blind.edges)
    assert guided.lines > blind.lines


def test_only_the_target_modules_are_traced() -> None:
    stats = fuzz("proxy_auth", seed=3, iterations=200)
    assert {filename for filename, _, _ in stats.edges} == {runs.__file__}
    toy = fuzz(TOY, seed=3, iterations=200)
    assert {filename for filename, _, _ in toy.edges} == {toy_parser.__file__}


def test_a_failure_reports_the_input() -> None:
    with pytest.raises(FuzzFailure, match="input: 00"):
        raise FuzzFailure("clienthello", b"\x00", "example")
    check_clienthello(b"\x16\x03\x01")  # need more: fine


def test_the_standalone_script_prints_coverage_and_corpus(capsys) -> None:
    assert main(["--seconds", "0.5", "--seed", "7", "--target", "dns", "--target", "proxy_auth"]) == 0
    out = capsys.readouterr().out
    assert "dns:" in out and "proxy_auth:" in out and "no failure (seed 7)" in out
    assert "lines " in out and "corpus " in out and "/s)" in out


def test_the_standalone_script_exits_1_with_the_input_in_hex(monkeypatch, capsys) -> None:
    def broken(data: bytes) -> None:
        raise FuzzFailure("dns", data, "planted")

    monkeypatch.setitem(TARGETS, "dns", fuzz_parsers.dataclasses.replace(TARGETS["dns"], check=broken))
    assert main(["--seconds", "0.2", "--seed", "7", "--target", "dns"]) == 1
    err = capsys.readouterr().err
    assert "FAIL (seed 7) dns: planted" in err and "input: " in err


# The oracles catch what they are there for: each is shown a parser that is wrong on purpose.


def test_the_proxy_auth_oracle_refuses_credentials_from_a_lenient_parser(monkeypatch) -> None:
    monkeypatch.setattr(fuzz_parsers, "parse_proxy_authorization", lambda value: ("r-fuzz", "T0k3n_-fuzz"))
    with pytest.raises(FuzzFailure, match="strict Basic says None"):
        check_proxy_auth(b"Bearer x")
    check_proxy_auth(b"Basic " + fuzz_parsers._b64(b"r-fuzz:T0k3n_-fuzz"))  # the right ones pass


def test_the_chunked_oracle_refuses_a_scanner_that_takes_bytes_past_the_end(monkeypatch) -> None:
    class Greedy(ChunkedScanner):
        def feed(self, data):  # type: ignore[no-untyped-def]
            super().feed(data)
            return len(data)

    check_chunked(b"1\r\na\r\n0\r\n\r\nNEXT")
    monkeypatch.setattr(fuzz_parsers, "ChunkedScanner", Greedy)
    with pytest.raises(FuzzFailure):
        check_chunked(b"1\r\na\r\n0\r\n\r\nNEXT")


def test_the_reference_chunked_decoder() -> None:
    assert reference_chunked(b"5\r\nhello\r\n0\r\n\r\nX") == ("done", 15, 5, 5)
    assert reference_chunked(b"3;a=b\r\nabc\r\n0\r\nT: 1\r\n\r\n") == ("done", 23, 3, 3)
    assert reference_chunked(b"5\r\nhel")[0] == "more"
    assert reference_chunked(b"5\nhello\r\n0\r\n\r\n")[0] == "bad"
    assert reference_chunked(b"5 \r\nhello\r\n0\r\n\r\n")[0] == "bad"
    assert reference_chunked(b"0\r\nno colon\r\n\r\n")[0] == "bad"
    assert reference_chunked(b"1" * 17 + b"\r\n")[0] == "bad"


def test_the_atheris_entry_point_runs_a_target_under_libfuzzer(tmp_path) -> None:
    require(importlib.util.find_spec("atheris") is not None, "atheris (the test extra, Linux x86_64)")
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.atheris_fuzz", "proxy_auth", "-runs=3000", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Done 3000 runs" in done.stderr
