"""datamover.units: size strings parsed into bytes, or an InvalidParameter naming the setting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datamover.errors import InvalidParameter
from datamover.units import GiB, KiB, MiB, parse_size


@pytest.mark.parametrize(
    ("text", "size"), [("4K", 4 * KiB), ("1GiB", GiB), ("64KiB", 64 * KiB), ("1.5M", 3 * MiB // 2), ("4096", 4096)]
)
def test_sizes(text, size):
    assert parse_size(text, "x") == size


@pytest.mark.parametrize("text", ["1e400", "inf", "-inf", "1e400K", "nan", "-1M", "4X", "", "K"])
def test_a_size_that_is_no_byte_count_names_the_setting(text):
    """ "1e400" and "inf" were an OverflowError (int of a float infinity), not the setting's error."""
    with pytest.raises(InvalidParameter, match=r"^ucx parameter 'X' must be"):
        parse_size(text, "ucx parameter 'X'")


@given(st.text(max_size=12))
def test_any_text_is_a_byte_count_or_invalid_parameter(text):
    try:
        assert parse_size(text, "x") >= 0
    except InvalidParameter as exc:
        assert str(exc).startswith("x must be")
