"""The hello parser and the name rules (DESIGN.md, "The hello")."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.errors import BAD_HELLO, BAD_NAME, CorralError
from supervisor.hello import MAX_HELLO_BYTES, Hello, check_name, parse_hello, safe_repr


def hello_line(**fields) -> bytes:
    return json.dumps({"corral": 1, **fields}).encode()


def test_valid_hello():
    """A well-formed hello yields the owner and conversation."""
    assert parse_hello(hello_line(owner="alice", conversation="c-42")) == Hello("alice", "c-42")


@pytest.mark.parametrize(
    "name",
    ["a", "A.b_c-d", "0abc", "x" * 64, "alice.2", "a..b"],
)
def test_accepted_names(name):
    """Names of 1-64 allowed characters starting with a letter or digit pass."""
    assert check_name("owner", name) == name


@pytest.mark.parametrize(
    "name",
    ["", "..", ".", "-a", "_a", ".hidden", "a/b", "/etc", "a\0b", "a\nb", "é", "a b",
     "x" * 65, "ａ", "a\u200b", "..%2f"],
)
def test_refused_names(name):
    """Path tricks, control characters, non-ASCII, empty and long names are bad_name."""
    with pytest.raises(CorralError) as caught:
        check_name("owner", name)
    assert caught.value.code == BAD_NAME


@pytest.mark.parametrize(
    "line, code",
    [
        (b"not json", BAD_HELLO),
        (b"[]", BAD_HELLO),
        (b'"alice"', BAD_HELLO),
        (b'{"owner": "a", "conversation": "b"}', BAD_HELLO),
        (b'{"corral": 2, "owner": "a", "conversation": "b"}', BAD_HELLO),
        (b'{"corral": true, "owner": "a", "conversation": "b"}', BAD_HELLO),
        (b'{"corral": 1, "conversation": "b"}', BAD_HELLO),
        (b'{"corral": 1, "owner": "a"}', BAD_HELLO),
        (b'{"corral": 1, "owner": "a", "conversation": "b", "x": 1}', BAD_HELLO),
        (b'{"corral": 1, "owner": 5, "conversation": "b"}', BAD_NAME),
        (b'{"corral": 1, "owner": "../root", "conversation": "b"}', BAD_NAME),
        (b'{"corral": 1, "owner": "a", "conversation": null}', BAD_NAME),
        (b"\xff\xfe", BAD_HELLO),
    ],
)
def test_refused_hellos(line, code):
    """Every malformed hello is refused with its stable code."""
    with pytest.raises(CorralError) as caught:
        parse_hello(line)
    assert caught.value.code == code
    assert caught.value.message


def test_oversized_hello():
    """A hello over 4096 bytes is refused even if it is valid JSON."""
    line = hello_line(owner="a", conversation="b", pad="x" * MAX_HELLO_BYTES)
    with pytest.raises(CorralError) as caught:
        parse_hello(line)
    assert caught.value.code == BAD_HELLO


def test_error_reply_shape():
    """A refusal becomes the documented {"ok": false, "error": {...}} reply."""
    reply = CorralError(BAD_NAME, "no").as_reply()
    assert reply == {"ok": False, "error": {"code": "bad_name", "message": "no"}}


def test_safe_repr_escapes_and_caps():
    """Hostile values in messages are escaped to one ASCII line and length-capped."""
    text = safe_repr("a\nb\x1b[31m" + "é" * 200)
    assert "\n" not in text and "\x1b" not in text and text.isascii()
    assert len(text) <= 80


@given(st.binary(max_size=5000))
def test_parse_hello_never_crashes(data):
    """Any bytes either parse into a Hello or raise CorralError, nothing else."""
    try:
        hello = parse_hello(data)
    except CorralError as e:
        assert e.code in (BAD_HELLO, BAD_NAME)
    else:
        assert check_name("owner", hello.owner) == hello.owner


@given(st.dictionaries(st.sampled_from(["corral", "owner", "conversation", "x"]),
                       st.one_of(st.integers(), st.text(max_size=70), st.none())))
def test_parse_hello_structured_fuzz(fields):
    """Structured near-misses never crash the parser."""
    try:
        parse_hello(json.dumps(fields).encode())
    except CorralError:
        pass
