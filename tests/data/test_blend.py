"""``--data-path`` and ``--split`` parsed as Megatron takes them; bad values and missing files
refused in one line before any process group."""

import pytest

from megapipe.data.blend import (
    INDEX_MAGIC,
    Blend,
    check_data_path,
    is_indexed_prefix,
    parse_data_path,
    parse_split,
)
from megapipe.data.errors import DataError


@pytest.mark.parametrize("values,blend", [
    (["A"], Blend(("A",), None)),
    (["A", "B"], Blend(("A", "B"), None)),  # blended in proportion to their sizes
    (["0.3", "A", "0.7", "B"], Blend(("A", "B"), (0.3, 0.7))),
    (["30", "A", "70", "B"], Blend(("A", "B"), (30.0, 70.0))),  # Megatron normalizes
    (["1e-1", "A"], Blend(("A",), (0.1,))),
])
def test_data_path_parses(values, blend):
    assert parse_data_path(values) == blend


@pytest.mark.parametrize("values,message", [
    ([], "needs at least one dataset prefix"),
    (["0.3", "A", "0.7"], "must alternate .* got 3 values"),
    (["0.3", "A", "x", "B"], "weight 'x' is not a number"),
    (["0.3", "A", "-0.7", "B"], "weight -0.7 must be a finite number > 0"),
    (["0", "A"], "weight 0 must be a finite number > 0"),
    (["inf", "A"], "weight inf must be a finite number > 0"),
    (["0.3", "0.7"], "'0.7' stands where a prefix should"),
])
def test_bad_weights_are_one_line(values, message):
    with pytest.raises(DataError, match=message) as err:
        parse_data_path(values)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("split,shares", [
    ("969,30,1", (0.969, 0.030, 0.001)), ("98,2", (0.98, 0.02, 0.0)), ("1/1/2", (0.25, 0.25, 0.5)),
    ("100", (1.0, 0.0, 0.0)),
])
def test_split_parses(split, shares):
    assert parse_split(split) == pytest.approx(shares)


@pytest.mark.parametrize("split,message", [
    ("98,2,x", "'x' is not a number"), ("98,-2", "'-2' is not a number >= 0"),
    ("1,1,1,1", "at most 3 shares"), ("0,0", "sum to 0"), ("", "'' is not a number"),
])
def test_bad_split_is_one_line(split, message):
    with pytest.raises(DataError, match=message):
        parse_split(split)


def test_prefix_files_are_checked(tmp_path):
    prefix = str(tmp_path / "d_text_document")
    assert not is_indexed_prefix(prefix)
    with pytest.raises(DataError, match=r"d_text_document.idx does not exist \(megapipe "):
        check_data_path([prefix])
    (tmp_path / "d_text_document.bin").write_bytes(b"\0\0")
    assert is_indexed_prefix(prefix)
    with pytest.raises(DataError, match=r"d_text_document.idx does not exist$"):
        check_data_path([prefix])
    (tmp_path / "d_text_document.idx").write_bytes(b"not an index")
    with pytest.raises(DataError, match="is not a Megatron index file"):
        check_data_path([prefix])
    (tmp_path / "d_text_document.idx").write_bytes(INDEX_MAGIC + b"\1")
    assert check_data_path(["1", prefix]) == Blend((prefix,), (1.0,))
    with pytest.raises(DataError, match="name the prefix without .bin"):
        check_data_path([prefix + ".bin"])
    (tmp_path / "d_text_document.bin").unlink()
    with pytest.raises(DataError, match=r"\.idx has no .*d_text_document.bin beside it"):
        check_data_path(["0.5", prefix, "0.5", prefix])
