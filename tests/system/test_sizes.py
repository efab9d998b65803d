"""One reading of sizes (pytest_llmload.system.sizes) for max_memory budgets and limit_torch_memory limits: accelerate's."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_llmload.system.sizes import format_bytes, parse_size


@pytest.fixture(scope="module")
def accelerate_utils():
    # Imported by the test that needs it, not at collection: a `-m gpu` run on a CPU runner imports no torch.
    return pytest.importorskip("accelerate.utils")

UNITS = ["KB", "MB", "GB", "KiB", "MiB", "GiB", "Kb", "Mb", "Gb", "kb", "mb", "gb", "kib", "GIB"]


@given(number=st.decimals(min_value=0, max_value=10**4, places=3, allow_nan=False, allow_infinity=False),
       unit=st.sampled_from(UNITS), space=st.sampled_from(["", " "]))
def test_every_size_accelerate_accepts_reads_the_same(accelerate_utils, number, unit, space):
    text = f"{number}{space}{unit}"
    assert parse_size(text) == accelerate_utils.convert_file_size_to_int(text)


@pytest.mark.parametrize(("text", "nbytes"), [("24Mb", 3_000_000), ("24 mb", 3_000_000), ("24MB", 24_000_000),
                                              ("2TB", 2 * 10**12), ("1TiB", 2**40), ("100 B", 100), ("7", 7)])
def test_what_it_reads_beyond_accelerate(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(("value", "why"), [
    ("lots", "'lots' is not a size"), ("24 parsecs", "'24 parsecs' is not a size (unknown unit 'parsecs')"),
    (True, "True is a bool, not a size"), ([1], "[1] is a list, not a size"), (-1, "-1 is negative"),
])
def test_a_bad_size_is_named(value, why):
    with pytest.raises(ValueError, match=f"^limit {__import__('re').escape(why)}$"):
        parse_size(value, what="limit")


def test_positive_refuses_zero_and_format_bytes_prints_binary_units():
    with pytest.raises(ValueError, match="0 is not a positive size"):
        parse_size(0, positive=True)
    assert [format_bytes(n) for n in (100, 1536, 3 * 2**20, 5 * 2**40)] == ["100 B", "1.5 KiB", "3.0 MiB", "5120.0 GiB"]
