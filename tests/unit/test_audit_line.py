"""An audit record's line: the short road (``line.head``) writes exactly what ``json.dumps`` writes.

Both heads are held to it where the compiled one is installed (``HEADS``):
the Python reference and ``egressd_native``'s (test_audit_native.py checks
that the compiled one really writes the records it should, not only hands
them back).

The general path is ``json.dumps(record, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)``; every record, however hostile its
strings and numbers, must come out byte for byte the same, or fail the same
way, whether its shape is new or was seen before with friendlier values.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from egressd.audit import line
from egressd.audit.log import JsonlAuditSink
from egressd.audit.records import EGRESS_FIELDS, EgressDecided, EgressEnded
from egressd.vocabulary.egress import Decision, EgressKind


def _dumps(record: object) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _expected_head(record: dict[object, object]) -> str:
    body = _dumps(record)
    return body[:-1] + ("," if record else "")


# The heads under test: the Python reference, and the one egressd writes with when it is another.
HEADS = [line.python_head] + ([line.head] if line.head is not line.python_head else [])


def _same_as_json(record: dict[object, object]) -> None:
    """Each head gives json.dumps's bytes (less the brace), or the exception type json.dumps raises."""
    try:
        expected = _expected_head(record)
    except (TypeError, ValueError) as exc:
        for head in HEADS:
            with pytest.raises(type(exc)):
                head(record)
        return
    for head in HEADS:
        assert head(record) == expected
    assert line.encode(record) == _dumps(record)


class _Reason(enum.StrEnum):
    DENIED = "denied"


class _Port(enum.IntEnum):
    HTTPS = 443


class _Text(str):
    def __str__(self) -> str:
        return "not what json writes"


_ADVERSARIAL_TEXT = [
    "",
    '"',
    "\\",
    "\\u0000",
    "\x00",
    "\x1f",
    "\x7f",
    "\n",
    "\u2028",
    "é",
    "\ud800",  # a lone surrogate
    "\udfff",
    "\U0001f600",
    "%s",
    "%%",
    "%(x)s",
    "%d%r",
    "null",
    "pypi.org",
]
_FLOATS = [
    0.0,
    -0.0,
    1e-05,
    1.2e-05,
    5e-324,
    -5e-324,
    1.7976931348623157e308,
    0.1,
    1e16,
    1e22,
    2.5,
    math.nan,
    math.inf,
    -math.inf,
]


def _power_of_ten(exponent: int) -> int:
    """10**exponent, signed as exponent is (a strategy's value: hypothesis cannot show an int past 4300 digits)."""
    return 10 ** abs(exponent) * (1 if exponent >= 0 else -1)


_text = st.one_of(
    st.sampled_from(_ADVERSARIAL_TEXT), st.text(st.characters(codec=None, exclude_categories=())), st.text()
)
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([4400, -4400, 64, -63]).map(_power_of_ten),  # past the int-to-str digit limit, and wide
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(_FLOATS),
    _text,
    st.sampled_from([_Reason.DENIED, _Port.HTTPS, _Text("x"), _Text('"')]),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6,
)
_key = st.one_of(st.sampled_from([*EGRESS_FIELDS, "qtype", "answer", "%s", "100%", '"k"', "\x00", "\ud800"]), _text)


@st.composite
def _records_of_one_shape(draw: st.DrawFn) -> list[dict[object, object]]:
    """Records with the same keys in the same order, values drawn for each (the same types, often)."""
    keys = draw(st.lists(_key, max_size=20, unique=True))
    if draw(st.booleans()):
        keys.append(draw(st.sampled_from([1, 1.5, None, True])))  # a key json turns into a string
    first = [draw(_value) for _ in keys]
    records = [dict(zip(keys, first, strict=True))]
    for _ in range(draw(st.integers(1, 3))):
        values = []
        for value in first:
            kind = draw(st.sampled_from(["same type", "any"]))
            if kind == "same type" and value.__class__ is str:
                values.append(draw(_text))
            elif kind == "same type" and value.__class__ is float:
                values.append(draw(st.one_of(st.floats(allow_nan=True), st.sampled_from(_FLOATS))))
            elif kind == "same type" and value.__class__ is int:
                values.append(draw(st.one_of(st.integers(), st.just(4400).map(_power_of_ten))))
            else:
                values.append(draw(_value))
        records.append(dict(zip(keys, values, strict=True)))
    return records


@settings(max_examples=600, deadline=None)
@given(_records_of_one_shape())
@example([{"event": "egress", "host": "a.test"}, {"event": "egress", "host": 'a"b'}])
@example([{"host": "a.test"}, {"host": "caf\u00e9.test"}, {"host": "\ud800"}, {"host": "a\x00"}])
@example([{"port": 443}, {"port": 2**64}, {"port": True}, {"port": _Port.HTTPS}])
@example([{"d": 1.5}, {"d": math.nan}, {"d": math.inf}, {"d": 1e308 * 10}])
@example([{"d": 1e308, "e": 1e308}, {"d": 1.0, "e": -math.inf}])  # a sum that overflows, then one that is inf
@example([{"%s": "x", "a%": None}, {"%s": "%s", "a%": None}])
@example([{"h": "x"}, {"h": _Text("x")}, {"h": _Reason.DENIED}])
@example([{}, {}])
def test_head_is_json_dumps_for_any_record_of_a_shape_seen_or_not(records: list[dict[object, object]]) -> None:
    for record in records:
        _same_as_json(record)
    for record in reversed(records):  # each shape now learnt, from whichever record came first
        _same_as_json(record)


def test_a_shape_is_learnt_once_and_the_cache_stays_bounded() -> None:
    line._SHAPES.clear()
    record = {"event": "egress", "host": "a.test", "port": 443}
    line.python_head(record)
    line.python_head({"event": "egress", "host": "b.test", "port": 80})
    assert len(line._SHAPES) == 1
    for n in range(line._MAX_SHAPES + 10):
        line.python_head({f"k{n}": n})
    assert len(line._SHAPES) <= line._MAX_SHAPES
    assert line.python_head(record) == _expected_head(record)


def test_a_circular_record_fails_as_json_does_and_the_next_one_is_written() -> None:
    record: dict[str, object] = {"event": "x"}
    record["self"] = record
    with pytest.raises(ValueError, match="Circular"):
        line.head(record)
    assert line.head({"event": "y"}) == '{"event":"y",'


def _facts() -> list[object]:
    ts = time.time()
    return [
        EgressDecided(
            id="q-0123456789abcdef",
            ts=ts,
            run="default",
            kind=EgressKind.CONNECT,
            client="127.0.0.1:40000",
            host="pypi.org",
            port=443,
            address="151.101.0.223",
            decision=Decision.ALLOW,
            reason=None,
            rule="pypi.org",
            approval=None,
            command="pip install x",
        ),
        EgressDecided(
            id="q-0123456789abcdef",
            ts=ts,
            run=None,
            kind=EgressKind.DNS,
            client="127.0.0.1:40000",
            host="caf\u00e9.test",
            port=None,
            address=None,
            decision=Decision.DENY,
            reason="not_allowed",
            rule=None,
            approval={"id": "a-1", "channel": "cli", "by": None, "waited_s": 1.25},
            command=None,
            bytes_up=0,
            bytes_down=0,
            duration_s=1.2e-05,
            extra={"qtype": "A", "answer": "NXDOMAIN", "transport": "udp", "detail": 'say "hi"\n'},
        ),
        EgressEnded(
            id="q-0123456789abcdef",
            ts=ts,
            run="default",
            address="151.101.0.223",
            bytes_up=123,
            bytes_down=4567,
            duration_s=0.123456789,
            end="closed",
            extra={"status": 200},
        ),
    ]


def test_the_sink_writes_each_fact_as_json_dumps_with_prev_last(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    records = [fact.record() for fact in _facts()]  # type: ignore[attr-defined]
    with JsonlAuditSink(path) as sink:
        for record in records:
            sink.write(record)
            sink.write(record)  # the second time, its shape is known
    lines = path.read_bytes().splitlines(keepends=True)
    prev = None
    expected = []
    for record in records:
        for _ in range(2):
            data = (_dumps({**record, "prev": prev}) + "\n").encode("ascii")
            expected.append(data)
            prev = hashlib.sha256(data).hexdigest()
    assert lines == expected
