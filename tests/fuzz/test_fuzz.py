"""The fuzz targets, briefly and with fixed seeds, so CI runs them on every change."""

from __future__ import annotations

import pytest

from tests.fuzz.fuzz_parsers import TARGETS, FuzzFailure, check_clienthello, fuzz, main


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_target_finds_nothing(target: str, seed: int) -> None:
    assert fuzz(target, seed=seed, iterations=1500) == 1500


def test_a_failure_reports_the_input() -> None:
    with pytest.raises(FuzzFailure, match="input: 00"):
        raise FuzzFailure("clienthello", b"\x00", "example")
    check_clienthello(b"\x16\x03\x01")  # need more: fine


def test_the_standalone_script_runs(capsys) -> None:
    assert main(["--seconds", "0.2", "--seed", "7"]) == 0
    assert "no failure (seed 7)" in capsys.readouterr().out
