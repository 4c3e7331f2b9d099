"""A mutation fuzzer for the parsers that read what a sandbox sends first.

Targets:

- ``clienthello``: ``parse_client_hello`` on mutated real and hand-built
  ClientHellos. It must return a ClientHello, return None (need more) or
  raise ClientHelloError; a complete answer must not change when more bytes
  follow, and every prefix of an input that parsed must give None or the
  same answer.
- ``dns``: ``read_query`` then ``plan_answer`` and ``pack_reply`` on mutated
  queries. A packet is a Query or a DnsQueryError (whose reply, if any, is a
  response); a query always yields a reply dnslib can read back.

No coverage guidance (atheris does not build here); instead the mutations
know the formats: they flip bits, but also rewrite the length fields and
counts that the parsers trust, cut, splice and duplicate. Deterministic for
a seed. Standalone::

    python -m tests.fuzz.fuzz_parsers --seconds 60 [--seed N] [--target clienthello|dns]

exits 1 and prints the input (hex) on the first failure.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address

from dnslib import DNSRecord

from proxy.clienthello import ClientHello, ClientHelloError, parse_client_hello
from proxy.dnsserver import DnsQueryError, pack_reply, plan_answer, read_query
from proxy.policy import Reason
from tests.fakes import hellos

_INTERESTING = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x3FFF, 0x4000, 0x4001, 0xFFFF)


def hello_seeds() -> list[bytes]:
    seeds = [
        hellos.python_hello("origin.test"),
        hellos.python_hello(None),
        hellos.client_hello("grease.example.test", grease=True, padding=100),
        hellos.client_hello("legacy.test", tls13=False, grease=False),
        hellos.client_hello(None, extensions=False),
        hellos.records(hellos.handshake(hellos.body("frag.test")), [1, 2, 3, 50]),
    ]
    return seeds


def dns_seeds() -> list[bytes]:
    seeds = [
        DNSRecord.question(name, qtype).pack()
        for name, qtype in (
            ("origin.test", "A"),
            ("a" * 63 + ".exfil.test", "AAAA"),
            ("x.test", "TXT"),
            ("_dmarc.example.test", "ANY"),
        )
    ]
    with_edns = DNSRecord.question("edns.test", "A")
    with_edns.add_ar(__import__("dnslib").EDNS0(udp_len=1232))
    seeds.append(with_edns.pack())
    return seeds


def mutate(data: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if not buf:
            buf += bytes([rng.randrange(256)])
            continue
        i = rng.randrange(len(buf))
        if op == 0:
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[i] = rng.randrange(256)
        elif op == 2 and i + 1 < len(buf):
            struct.pack_into("!H", buf, i, rng.choice(_INTERESTING))  # a length or count field
        elif op == 3:
            del buf[i : i + rng.randint(1, 16)]
        elif op == 4:
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 5:
            buf = buf[: rng.randrange(len(buf) + 1)]
        elif op == 6:
            other = rng.choice(pool)
            j = rng.randrange(len(other) + 1)
            buf = buf[:i] + bytearray(other[j:])
        else:
            k = rng.randint(1, 32)
            buf[i:i] = buf[i : i + k]
    return bytes(buf)


class FuzzFailure(AssertionError):
    def __init__(self, target: str, data: bytes, why: str) -> None:
        super().__init__(f"{target}: {why}\ninput: {data.hex()}")
        self.data = data


def check_clienthello(data: bytes) -> None:
    try:
        result = parse_client_hello(data)
    except ClientHelloError:
        return
    except Exception as exc:  # noqa: BLE001 - the point is to catch anything else
        raise FuzzFailure("clienthello", data, f"raised {exc!r}") from exc
    if result is None:
        return
    if not isinstance(result, ClientHello):
        raise FuzzFailure("clienthello", data, f"returned {result!r}")
    if parse_client_hello(data + b"\x16\x03\x01\x00\x01\x01") != result:
        raise FuzzFailure("clienthello", data, "bytes after a complete hello changed the answer")
    for cut in range(0, len(data), max(1, len(data) // 16)):
        try:
            prefix = parse_client_hello(data[:cut])
        except ClientHelloError as exc:
            raise FuzzFailure("clienthello", data, f"prefix {cut} raised although the whole parsed") from exc
        if prefix not in (None, result):
            raise FuzzFailure("clienthello", data, f"prefix {cut} gave another answer")


def check_dns(data: bytes) -> None:
    try:
        query = read_query(data)
    except DnsQueryError as exc:
        if exc.reply is not None and not DNSRecord.parse(exc.reply).header.qr:
            raise FuzzFailure("dns", data, "an error reply that is not a response") from exc
        return
    except Exception as exc:  # noqa: BLE001
        raise FuzzFailure("dns", data, f"read_query raised {exc!r}") from exc
    for unreachable in (None, Reason.DENYLISTED):
        try:
            plan = plan_answer(
                query, answer4=IPv4Address("10.0.0.1"), answer6=IPv6Address("fd00::1"), unreachable=unreachable
            )
            packed = pack_reply(query, plan, 5)
            reply = DNSRecord.parse(packed)
        except Exception as exc:  # noqa: BLE001
            raise FuzzFailure("dns", data, f"answering raised {exc!r}") from exc
        if reply.header.id != query.ident or not reply.header.qr or tuple(reply.q.qname.label) != query.labels:
            raise FuzzFailure("dns", data, "the reply does not answer the query")
        # The reply as sent (dnslib cannot re-pack a label over 63 octets,
        # which a FORMERR reply echoes): within 512 octets, or no longer
        # than the query whose question it repeats.
        if len(packed) > max(512, len(data)):
            raise FuzzFailure("dns", data, "a reply longer than 512 octets and than the query")


TARGETS: dict[str, tuple[Callable[[], list[bytes]], Callable[[bytes], None]]] = {
    "clienthello": (hello_seeds, check_clienthello),
    "dns": (dns_seeds, check_dns),
}


def fuzz(target: str, *, seed: int, iterations: int | None = None, seconds: float | None = None) -> int:
    """Run ``target`` until ``iterations`` inputs or ``seconds`` pass; the count run. Raises FuzzFailure."""
    make_seeds, check = TARGETS[target]
    rng = random.Random(seed)
    pool = make_seeds()
    for data in pool:
        check(data)
    deadline = time.monotonic() + seconds if seconds is not None else None
    done = 0
    while (iterations is None or done < iterations) and (deadline is None or time.monotonic() < deadline):
        data = mutate(rng.choice(pool), rng, pool)
        check(data)
        if len(pool) < 256 and rng.random() < 0.05:
            pool.append(data)  # mutations of mutations reach deeper
        done += 1
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--target", choices=sorted(TARGETS), action="append")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    targets = args.target or sorted(TARGETS)
    for target in targets:
        try:
            count = fuzz(target, seed=seed, seconds=args.seconds / len(targets))
        except FuzzFailure as failure:
            print(f"FAIL (seed {seed}) {failure}", file=sys.stderr)
            return 1
        print(f"{target}: {count} inputs, no failure (seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
