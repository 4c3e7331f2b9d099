"""Facts' records built the quick way say what the plain way says: time stamps, hosts, durations."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from egressd.audit import fields, records
from egressd.audit.fields import RecordError
from egressd.audit.records import EgressDecided, EgressEnded, rfc3339
from egressd.vocabulary.egress import Decision, EgressKind


def _rfc3339_plainly(ts: object) -> str:
    """rfc3339 as first written: ``ts // 1``, an f-string, no remembered second."""
    try:
        second = int(ts // 1)  # type: ignore[operator]
        micros = round((ts - second) * 1_000_000)  # type: ignore[operator]
        if micros == 1_000_000:
            second, micros = second + 1, 0
        text = dt.datetime.fromtimestamp(second, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    except (OverflowError, OSError, ValueError, TypeError) as exc:
        raise RecordError(f"not a timestamp: {ts!r}") from exc
    return f"{text}.{micros:06d}Z"


@given(
    st.one_of(
        st.floats(min_value=-1e10, max_value=4e10),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(10**12), max_value=10**12),
        st.sampled_from([0.5, 0.9999995, 1_764_633_599.9999996, -0.0, 5e-324, 1e300]),
        st.sampled_from([Decimal("-1.5"), Decimal("1764633600.25"), Fraction(-3, 2), True, "1", None]),
    )
)
@example(1_764_633_600.0)
@example(1_764_633_600.0000004)
def test_rfc3339_is_the_plain_formula(ts: object) -> None:
    try:
        expected = _rfc3339_plainly(ts)
    except RecordError:
        with pytest.raises(RecordError):
            rfc3339(ts)  # type: ignore[arg-type]
        return
    assert rfc3339(ts) == expected  # type: ignore[arg-type]
    assert rfc3339(ts) == expected  # type: ignore[arg-type]  # the second remembered


_hosts = st.one_of(
    st.none(),
    st.text(),
    st.sampled_from(["pypi.org", "u:p@h.test", "a/b@c.test/d?e#f", "h.test?q=1", "h.test#x", "@", "/"]),
)
_durations = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.sampled_from([True, Decimal("1.5"), "1.5", 0.1234565, 2.5e-7]),
)


def _plain_seconds(value: object) -> object:
    try:
        return fields.seconds(value, "duration_s")  # type: ignore[arg-type]
    except RecordError:
        return RecordError


@given(_hosts, _durations)
def test_an_egress_record_strips_its_host_and_rounds_its_duration_as_the_helpers_do(
    host: str | None, duration: object
) -> None:
    fact = EgressDecided(
        id="q-1",
        ts=1_764_633_600.25,
        run=None,
        kind=EgressKind.TLS,
        client=None,
        host=host,
        port=443,
        address=None,
        decision=Decision.DENY,
        reason="not_allowed",
        rule=None,
        approval=None,
        command=None,
        duration_s=duration,  # type: ignore[arg-type]
    )
    expected = _plain_seconds(duration)
    if expected is RecordError:
        with pytest.raises(RecordError):
            fact.record()
        return
    record = fact.record()
    assert record["host"] == fields.strip_host(host)
    assert record["duration_s"] == expected and type(record["duration_s"]) is type(expected)
    assert list(record) == list(records.EGRESS_FIELDS)


@given(_durations.filter(lambda d: d is not None))
def test_an_end_record_rounds_its_duration_as_the_helper_does(duration: object) -> None:
    fact = EgressEnded(
        id="q-1",
        ts=0.0,
        run="r",
        address=None,
        bytes_up=1,
        bytes_down=2,
        duration_s=duration,
        end="closed",  # type: ignore[arg-type]
    )
    expected = _plain_seconds(duration)
    if expected is RecordError:
        with pytest.raises(RecordError):
            fact.record()
        return
    value = fact.record()["duration_s"]
    assert value == expected and type(value) is type(expected)
    if isinstance(value, float):
        assert math.isfinite(value)
