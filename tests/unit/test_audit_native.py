"""The compiled audit line (``egressd_native``) against the Python reference, fed the same records and heads.

test_audit_line.py holds both heads to ``json.dumps`` over hostile records;
here: the compiled head writes the records egressd writes itself (it does not
hand them all back to Python, which would pass any comparison), the chain is
the same bytes and hashes, a log written either way is the same file, and
which one egressd uses is chosen as ``egressd.audit.native`` says. Under
``CI=true`` the compiled one must be installed: CI tests both.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.audit import line, native
from egressd.audit.log import JsonlAuditSink

compiled = native.MODULE
# On CI the compiled line is required, unless the pass runs with EGRESSD_NATIVE set (the Python pass).
needs_compiled = pytest.mark.skipif(
    compiled is None and (os.environ.get("CI") != "true" or native.ENV in os.environ),
    reason=f"the compiled audit line is not in use here: {native.DESCRIPTION}",
)


def test_ci_has_the_compiled_line() -> None:
    if os.environ.get("CI") == "true" and os.environ.get(native.ENV) is None:
        assert compiled is not None, native.DESCRIPTION
        assert line.head is not line.python_head and line.chain is not line.python_chain


class _Counting:
    """The Python head, counting the records the compiled one hands it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, record: Mapping[str, object]) -> str:
        self.calls += 1
        return line.python_head(record)


def _outcome(head: Callable[[object], str], record: object) -> object:
    """The head's text, or the type of the exception it raised."""
    try:
        return head(record)
    except (TypeError, ValueError) as exc:
        return type(exc)


_plain_text = st.text(st.characters(codec="utf-8"), max_size=40)  # no lone surrogate: UTF-8 holds it
_plain_value = st.one_of(
    st.none(),
    _plain_text,
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_plain_text, _plain_value, max_size=12))
def test_the_compiled_head_writes_every_plain_record_itself_and_as_python_does(record: dict[str, object]) -> None:
    assert compiled is not None
    fallback = _Counting()
    head = compiled.Head(fallback)
    assert head(record) == line.python_head(record)
    assert fallback.calls == 0


@needs_compiled
@pytest.mark.parametrize(
    "value",
    ["\ud800", 2**63, -(2**63) - 1, 10**5000, float("nan"), float("inf"), True, [1], {"a": 1}, b"x"],
    ids=["surrogate", "2**63", "-2**63-1", "past-digit-limit", "nan", "inf", "bool", "list", "dict", "bytes"],
)
def test_what_the_compiled_head_does_not_take_goes_to_python_which_writes_or_raises_as_json(value: object) -> None:
    assert compiled is not None
    fallback = _Counting()
    head = compiled.Head(fallback)
    record = {"event": "egress", "v": value}
    assert (_outcome(head, record), fallback.calls) == (_outcome(line.python_head, record), 1)


@needs_compiled
def test_a_record_that_is_not_a_plain_dict_or_has_another_key_goes_to_python() -> None:
    assert compiled is not None

    class Record(dict[str, object]):
        pass

    class Key(str):
        pass

    for record in (Record(event="x"), {Key("event"): "x"}, {1: "x"}, types.MappingProxyType({"event": "x"})):
        fallback = _Counting()
        assert _outcome(compiled.Head(fallback), record) == _outcome(line.python_head, record)
        assert fallback.calls == 1


_head = st.builds(line.python_head, st.dictionaries(_plain_text, _plain_value, max_size=6))
_prev = st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(lambda b: b.hex()))


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(_head, max_size=8), _prev)
def test_the_compiled_chain_is_the_python_chain(heads: list[str], prev: str | None) -> None:
    assert compiled is not None
    assert compiled.chain(heads, prev) == line.python_chain(heads, prev)


def test_the_python_chain_links_each_line_to_the_one_before() -> None:
    data, last = line.python_chain(['{"a":1,', "{"], None)
    first, second = data.splitlines(keepends=True)
    assert first == b'{"a":1,"prev":null}\n'
    assert second == b'{"prev":"' + hashlib.sha256(first).hexdigest().encode() + b'"}\n'
    assert last == hashlib.sha256(second).hexdigest()
    assert line.python_chain([], last) == (b"", last)


@pytest.mark.parametrize("chain", [line.python_chain, *([compiled.chain] if compiled else [])])
def test_a_head_that_is_not_ascii_is_refused(chain: object) -> None:
    with pytest.raises(ValueError):
        chain(['{"h":"\u00e9",'], None)  # type: ignore[operator]


def _write_log(path: Path, rotate: bool) -> list[bytes]:
    records: list[dict[str, object]] = [
        {"event": "egress", "id": f"q-{n:04x}", "host": f"h{n}.test", "port": 443, "duration_s": n / 7, "x": None}
        for n in range(60)
    ]
    records.insert(5, {"event": "dns", "host": "caf\u00e9.test", "detail": 'say "hi"\n', "big": 2**70})
    with JsonlAuditSink(path, max_bytes=2000 if rotate else 0, keep=50) as sink:
        for n, record in enumerate(records):
            (sink.write_ahead if n % 3 == 0 else sink.write)(record)
    return [p.read_bytes() for p in sorted(path.parent.glob(path.name + "*"))]


@needs_compiled
@pytest.mark.parametrize("rotate", [False, True], ids=["one-file", "rotated"])
def test_a_log_written_by_either_line_is_the_same_bytes(tmp_path: Path, rotate: bool) -> None:
    (tmp_path / "compiled").mkdir()
    (tmp_path / "python").mkdir()
    compiled_files = _write_log(tmp_path / "compiled" / "audit.jsonl", rotate)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(line, "head", line.python_head)
        mp.setattr(line, "chain", line.python_chain)
        python_files = _write_log(tmp_path / "python" / "audit.jsonl", rotate)
    assert compiled_files == python_files
    assert (len(python_files) > 3) == rotate


def _load_with(monkeypatch: pytest.MonkeyPatch, module: object, env: str | None) -> tuple[object, str]:
    if env is None:
        monkeypatch.delenv(native.ENV, raising=False)
    else:
        monkeypatch.setenv(native.ENV, env)
    monkeypatch.setitem(sys.modules, "egressd_native", module)  # None: an import that fails
    return native._load()


def test_egressd_native_0_chooses_python_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(INTERFACE=native.INTERFACE, __version__="9")
    module, description = _load_with(monkeypatch, fake, "0")
    assert module is None and description == "Python (EGRESSD_NATIVE=0)"
    module, description = _load_with(monkeypatch, fake, None)
    assert module is fake and description == "compiled (egressd_native 9)"


def test_a_build_of_another_interface_or_none_at_all_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    module, description = _load_with(monkeypatch, types.SimpleNamespace(INTERFACE=99, __version__="9"), None)
    assert module is None and "interface 99" in description and "rebuild" in description
    module, description = _load_with(monkeypatch, None, None)
    assert module is None and "not installed" in description
