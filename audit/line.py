"""A record as the text of its audit line: the JSON the sink writes, made cheaply.

Every line is ``json.dumps(record, separators=(",", ":"), ensure_ascii=True,
allow_nan=False)`` of the record, byte for byte (``encode``). One is built per
egress record, so the common record takes a shorter road (``head``): a record
of the same keys, in the same order, with values of the same types as one
seen before is written through a ``%`` template made for that shape, its keys
already escaped, its nulls already written. What the template cannot vouch
for is checked on every record, and anything else goes the general way:

1. the record is a plain ``dict`` whose keys are all plain ``str``;
2. every value is exactly ``str``, ``int``, ``float`` or ``None`` (a bool, an
   enum, a nested list or mapping: the general way);
3. the strings, taken together, are printable ASCII without ``"`` or ``\\``:
   JSON writes them as they are, between quotes (anything else is escaped);
4. the floats are finite (``allow_nan=False`` refuses the others), and are
   written by ``repr``, as ``json`` writes them; ints by ``%d``, which is
   ``int.__repr__`` for an exact ``int``.

Anything that fails on the short road (a huge int past the digit limit, ...)
is done again the general way, which gives the error, if there is one.

``chain`` makes the lines of a batch of heads: each ends with ``prev``, the
SHA-256 (hex) of the line before it, and a newline.

``head`` and ``chain`` are the compiled ones (``egressd_native``, chosen by
``egressd.audit.native``) where that is installed, else ``python_head`` and
``python_chain``; the Python ones are the reference, and the compiled head
hands them what it does not take. Pure: no I/O.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter

from egressd.audit import native

__all__ = ["chain", "encode", "head", "python_chain", "python_head"]

# One encoder for every line: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)
# What ``_ENCODER.encode`` builds anew on every call (``JSONEncoder.iterencode``), built once: the C
# encoder with the same arguments (the same bytes by construction). ``_MARKERS`` is its
# circular-reference check, empty between calls (an encoding that failed halfway leaves ids in it:
# ``encode`` clears it). None where ``_json`` is missing.
_MARKERS: dict[int, object] = {}
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed: _json's, or None
_C_ENCODE = (
    None
    if _C_MAKE_ENCODER is None
    else _C_MAKE_ENCODER(
        _MARKERS,
        _ENCODER.default,
        json.encoder.encode_basestring_ascii,
        None,  # indent
        ":",
        ",",
        False,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )
)

_escape = json.encoder.encode_basestring_ascii

_Pick = Callable[[tuple[object, ...]], tuple[object, ...]]


class _Shape:
    """What the records of one shape (keys, and the type of each value) are written with."""

    __slots__ = ("floats", "present", "strings", "template")

    def __init__(self, template: str, present: _Pick | None, strings: _Pick | None, floats: _Pick | None) -> None:
        self.template = template  # ``{"key":%s,...,`` with the nulls written in
        self.present = present  # the values the template takes, all but the Nones (None: all of them)
        self.strings = strings  # the str values, to check (None: there are none)
        self.floats = floats  # the float values, to check (None: there are none)


# Shapes seen, and None for a shape the short road does not take. Egress records come in a few
# dozen shapes (which fields are null, which extras); bounded all the same.
_SHAPES: dict[tuple[tuple[object, ...], tuple[type, ...]], _Shape | None] = {}
_MAX_SHAPES = 512
# A value's type, and its conversion in a template (NoneType: written in; no entry: the general way).
_CONVERSIONS: dict[type, str] = {str: '"%s"', int: "%d", float: "%r"}


def encode(record: object) -> str:
    """``json.dumps(record, separators=(",", ":"), ensure_ascii=True, allow_nan=False)``.

    ``TypeError`` or ``ValueError`` for what JSON cannot hold, as ``json.dumps`` raises them.
    """
    if _C_ENCODE is None or record.__class__ is not dict:
        return _ENCODER.encode(record)
    try:
        return "".join(_C_ENCODE(record, 0))  # _ENCODER.encode(record), without its call
    except BaseException:
        _MARKERS.clear()
        raise


def python_head(record: Mapping[str, object]) -> str:
    """``encode(record)`` without its closing brace, and with a comma after its last field if it has one.

    What a field appended to the record is written after: ``head(r) +
    '"prev":null}'`` is ``encode({**r, "prev": None})`` for a record ``r``
    without ``prev``. Raises as ``encode`` does.
    """
    if record.__class__ is dict:
        values = tuple(record.values())
        key = (tuple(record), tuple(map(type, values)))
        try:
            shape = _SHAPES[key]
        except KeyError:
            shape = _learn(key)
        if shape is not None:
            try:
                if shape.strings is not None:
                    text = "".join(shape.strings(values))  # type: ignore[arg-type]  # str by the shape
                    if not (text.isascii() and text.isprintable()) or '"' in text or "\\" in text:
                        shape = None
                if shape is not None and shape.floats is not None:
                    total = sum(shape.floats(values))  # type: ignore[arg-type]  # floats by the shape
                    if total - total != 0.0:  # NaN or infinite: one of them is (or finite ones overflowed)
                        shape = None
                if shape is not None:
                    return shape.template % (values if shape.present is None else shape.present(values))
            except (TypeError, ValueError, OverflowError):
                pass  # the general way says what is wrong, if anything is
    body = encode(record)
    return body[:-1] + "," if len(body) > 2 else body[:-1]


def _learn(key: tuple[tuple[object, ...], tuple[type, ...]]) -> _Shape | None:
    """The ``_Shape`` of records with these keys and value types, remembered; None: the general way."""
    if len(_SHAPES) >= _MAX_SHAPES:
        _SHAPES.clear()
    keys, types = key
    shape: _Shape | None = None
    if all(name.__class__ is str for name in keys) and all(t is type(None) or t in _CONVERSIONS for t in types):
        fields = []
        for name, kind in zip(keys, types, strict=True):
            name_text = _escape(name).replace("%", "%%")  # type: ignore[arg-type]  # str, checked above
            fields.append(f"{name_text}:{'null' if kind is type(None) else _CONVERSIONS[kind]},")
        shape = _Shape(
            "{" + "".join(fields),
            None
            if type(None) not in types
            else _pick([i for i, t in enumerate(types) if t is not type(None)]) or _none,
            _pick([i for i, t in enumerate(types) if t is str]),
            _pick([i for i, t in enumerate(types) if t is float]),
        )
    _SHAPES[key] = shape
    return shape


def _pick(indices: list[int]) -> _Pick | None:
    """A function picking these items of a tuple, as a tuple (itemgetter of one index gives the item)."""
    if not indices:
        return None
    if len(indices) == 1:
        return itemgetter(slice(indices[0], indices[0] + 1))
    return itemgetter(*indices)


def _none(values: tuple[object, ...]) -> tuple[object, ...]:
    return ()


def python_chain(heads: Sequence[str], prev: str | None) -> tuple[bytes, str | None]:
    """The lines of ``heads`` (each ``head(record)``) chained after ``prev``, joined, and the last one's hash.

    A line is its head, ``"prev":`` the SHA-256 (hex) of the line before it
    (``null`` for the first line of a log) with the closing brace, and a
    newline; ``prev`` goes last, so the record's own fields keep their order.
    Returns ``prev`` itself for no heads. ``ValueError`` for a head that is
    not ASCII (a head never is: ``ensure_ascii``).
    """
    lines = []
    sha256 = hashlib.sha256
    for text in heads:
        data = (text + '"prev":null}\n' if prev is None else f'{text}"prev":"{prev}"}}\n').encode("ascii")
        lines.append(data)
        prev = sha256(data).hexdigest()
    return b"".join(lines), prev


head: Callable[[Mapping[str, object]], str] = python_head
chain: Callable[[Sequence[str], str | None], tuple[bytes, str | None]] = python_chain
if native.MODULE is not None:
    head = native.MODULE.Head(python_head)
    chain = native.MODULE.chain
