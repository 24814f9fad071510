"""Hypothesis strategies and settings shared by the fuzz tests (tests/test_fuzz_internal.py,
tests/cluster/test_fuzz_api.py): odd unicode, huge values, hand-made protobuf wire, mutations."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from google.protobuf.internal.encoder import _VarintBytes as _varint  # protobuf's own wire varint


def fuzz_settings(examples: int) -> settings:
    """Reproducible (CI runs the same examples every time), without deadlines: real sockets are slow at times."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# --- generators of bytes --------------------------------------------------------------------------
ODD_TEXT = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=40),  # every code point but surrogates: emoji, RTL, NUL
    st.sampled_from(["\0", "\u202e\u0645\u0631\u062d\u0628\u0627", "\ufeff", "e\u0301\u0301\u0301", "\U0001F600" * 50,
                     "\uffff\U0010ffff", "a" * 5000]),
)
U32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1]))
F32 = st.floats(width=32)  # NaN, infinities, subnormals included


@st.composite
def wire_fields(draw: st.DrawFn, field_numbers: list[int]) -> bytes:
    """Protobuf wire format by hand: the message's own field numbers with any wire type (wrong types),
    unknown numbers, varints up to 10 bytes, length prefixes past the end, bad UTF-8."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 6))):
        number = draw(st.one_of(st.sampled_from(field_numbers), st.integers(0, 2**29 - 1)))
        wire_type = draw(st.integers(0, 7))
        out += _varint(number << 3 | wire_type)
        if wire_type == 0:
            out += _varint(draw(st.integers(0, 2**70)))  # past 64 bits: a varint too long
        elif wire_type == 1:
            out += draw(st.binary(min_size=0, max_size=8))
        elif wire_type == 5:
            out += draw(st.binary(min_size=0, max_size=4))
        elif wire_type == 2:
            body = draw(st.one_of(st.binary(max_size=20), st.just(b"\xff\xfe\xc0\x80"),
                                  ODD_TEXT.map(lambda s: s.encode())))
            length = len(body) + draw(st.sampled_from([0, 0, 0, 1, 1000, 2**31]))  # sometimes past the end
            out += _varint(length) + body
        else:  # groups and invalid wire types
            out += draw(st.binary(max_size=4))
    return bytes(out)


def mutated(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A valid message with a byte flipped, inserted or deleted, or cut short."""
    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(valid))
        for _ in range(draw(st.integers(1, 3))):
            op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
            at = draw(st.integers(0, len(data)))
            if op == "flip" and at < len(data):
                data[at] ^= draw(st.integers(1, 255))
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=4))
            elif op == "delete":
                del data[at : at + 1]
            else:
                del data[at:]
        return bytes(data)
    return mutate()


def messages(good: st.SearchStrategy[bytes], bad: st.SearchStrategy[bytes],
             field_numbers: list[int]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes): "good" must parse, "bad" must not, "any" may go either way."""
    return st.one_of(
        good.map(lambda b: ("good", b)),
        bad.map(lambda b: ("bad", b)),
        st.binary(max_size=300).map(lambda b: ("any", b)),
        mutated(good).map(lambda b: ("any", b)),
        wire_fields(field_numbers).map(lambda b: ("any", b)),
    )
