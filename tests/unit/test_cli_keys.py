r"""How the `memkv` command writes and reads keys (memkv.cli.keys.format_key / parse_key).

Behaviour under test:
* `format_key` prints printable ASCII but space and backslash as is, a backslash as `\\` and
  every other byte as `\xNN`: one whitespace-free, terminal-safe token per key;
* `parse_key(format_key(k)) == k` for every byte string (hypothesis), and the printed form is a
  Python bytes-literal escape (codecs.escape_decode reads it back too);
* a key typed as text is taken as its UTF-8 bytes, and an argument that is not UTF-8 (which
  Python hands over with surrogate escapes) as its raw bytes;
* any other backslash sequence is a usage error naming the escape, before any I/O.
"""

from __future__ import annotations

import codecs
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memkv.cli.common import UsageError
from memkv.cli.keys import _key_arg, format_key, parse_key

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "key,printed",
    [
        (b"model_ab12/b65536/0/00ff", "model_ab12/b65536/0/00ff"),
        (b"a b", r"a\x20b"),
        (b"back\\slash", r"back\\slash"),
        (b"\x00\x1b[2J\x7f", r"\x00\x1b[2J\x7f"),
        ("caf\u00e9".encode(), r"caf\xc3\xa9"),
        (b"\xff", r"\xff"),
    ],
)
def test_format_key_escapes_everything_but_printable_ascii(key: bytes, printed: str) -> None:
    assert format_key(key) == printed
    assert parse_key(printed) == key


@given(st.binary(max_size=480))
def test_every_key_round_trips_through_its_printed_form(key: bytes) -> None:
    printed = format_key(key)
    assert printed.isascii() and not any(c.isspace() for c in printed)
    assert parse_key(printed) == key
    assert codecs.escape_decode(printed.encode())[0] == key


def test_a_typed_key_is_its_utf8_bytes_and_a_non_utf8_argument_its_raw_bytes() -> None:
    assert parse_key("caf\u00e9") == b"caf\xc3\xa9"
    assert parse_key(os.fsdecode(b"ns/\xff\xfe")) == b"ns/\xff\xfe"  # what sys.argv holds for it
    assert parse_key(r"upper\xAB") == b"upper\xab"


@pytest.mark.parametrize("text", [r"a\q", r"a\x4", r"a\x4g", "trailing\\", r"\n"])
def test_any_other_backslash_sequence_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="bad escape") as info:
        parse_key(text)
    assert r"write a backslash as \\" in str(info.value)


def test_a_key_argument_is_bounded_after_unescaping() -> None:
    assert _key_arg(r"\x00" * 480) == bytes(480)  # 1920 characters, 480 bytes: fine
    with pytest.raises(UsageError, match=r"1\.\.480 bytes, got 481"):
        _key_arg(r"\x00" * 481)
    with pytest.raises(UsageError, match="got 0"):
        _key_arg("")
