"""HTTP/1.1 message heads and body framing, without I/O (RFC 9112).

The modules, bottom first: ``syntax`` (the byte classes and ``HttpError``) →
``framing`` (how a body ends: ``BodyKind``, ``ChunkedScanner``) → ``heads``
(``RequestHead``, ``ResponseHead``, their parsers and body kinds) →
``destination`` (where a request asked to go) → ``forwarding`` (the heads sent on).

Bytes in, values out. The server reads from its sockets and calls, in order:

1. ``parse_request_head(buf, max_bytes)`` until it returns a head (``None``
   means "read more"); it consumed the bytes it says, the rest is body or
   the next request;
2. ``request_destination(head)``: where the client asked to go, taken from
   the request-target only (the Host header never decides it);
3. ``forward_request_head(head, destination)``: the head sent upstream, and
   ``request_body_kind(head)`` with a ``ChunkedScanner`` to relay the body
   unchanged: bodies are never decoded, we only find where they end;
4. ``parse_response_head``, ``response_body_kind`` and
   ``forward_response_head`` do the same for the answer.

A head that parsed has exactly one framing (RFC 9112 §6.3): every input a
peer could read differently from us (CL and TE together, differing
Content-Lengths, a coding after ``chunked``, obs-fold, bare CR, space before
a colon) is refused, so what we relay as one message is one message to the
upstream too: no request smuggling, no response splitting.

The common head and request-target are read by a fast path (a few compiled
expressions, run in C) that accepts a strict subset of what the general
parser accepts, with the same result; every other input, valid or not, goes
to the general parser, which decides it and words every refusal. A compiled
HTTP parser (httptools/llhttp) was measured and did not pay: its callbacks
cost as much as this path before any of our checks run.

Errors are ``HttpError`` with the status to answer. A request's errors are the
client's fault (400, 431, 501, 505); a response's errors are the upstream's
fault and always carry 502.
"""

