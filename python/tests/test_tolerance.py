"""The cross-machine tensor comparison (`tolerance.py`): last-bit differences pass, real ones
fail with the tensor's name and its largest absolute and relative errors."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from graph_walk import GOLDEN_DIR
from tolerance import TOLERANCES, assert_tensor_close, assert_tensors_close

GRAD = "ref/grad/t_12"  # a weight gradient of the committed dense reference


def committed() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN_DIR / "dense.safetensors")


def ulps_up(t: torch.Tensor, count: int) -> torch.Tensor:
    """`t` with every element moved `count` representable values towards +inf."""
    for _ in range(count):
        t = torch.nextafter(t, torch.full_like(t, float("inf")))
    return t


def test_one_ulp_everywhere_passes_for_every_reference_tensor():
    expected = committed()
    moved = {k: ulps_up(t, 1) if t.is_floating_point() else t for k, t in expected.items()}
    assert any(not torch.equal(moved[k], expected[k]) for k in expected)
    assert_tensors_close(moved, expected)


def test_a_large_error_fails_naming_the_tensor_and_its_errors():
    expected = committed()
    actual = dict(expected)
    actual[GRAD] = expected[GRAD].clone()
    actual[GRAD].view(-1)[3] += 1e-3
    with pytest.raises(AssertionError) as failure:
        assert_tensors_close(actual, expected)
    message = str(failure.value)
    assert message.startswith(f"{GRAD}: 1 of {expected[GRAD].numel()} torch.float32 elements")
    assert "flat index 3" in message
    max_abs = float(re.search(r"max abs error (\S+) ", message).group(1))
    max_rel = float(re.search(r"max rel error (\S+)$", message).group(1))
    assert max_abs == pytest.approx(1e-3, rel=1e-3)
    assert max_rel == pytest.approx(1e-3 / abs(expected[GRAD].view(-1)[3].item()), rel=1e-3)


def spread(dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(-2, 2, 101, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", sorted(TOLERANCES, key=str))
def test_each_dtype_accepts_a_few_ulps_and_rejects_four_times_its_allowance(dtype):
    expected = spread(dtype)
    assert_tensor_close("x", ulps_up(expected, 3), expected)
    rtol, atol = TOLERANCES[dtype]
    with pytest.raises(AssertionError, match=r"^x: \d+ of 101"):
        assert_tensor_close("x", expected * (1 + 4 * rtol) + atol, expected)


def test_bfloat16_needs_a_looser_tolerance_than_float32():
    expected = spread(torch.bfloat16)
    moved = ulps_up(expected, 3)
    rtol, atol = TOLERANCES[torch.float32]
    assert not torch.isclose(moved, expected, rtol=rtol, atol=atol).all()
    assert_tensor_close("x", moved, expected)


def test_integers_nans_dtypes_and_keys_are_compared_exactly():
    tokens = torch.arange(6)
    with pytest.raises(AssertionError, match="input: torch.int64 values differ"):
        assert_tensor_close("input", tokens + (tokens == 5), tokens)
    nan = torch.tensor([1.0, float("nan")])
    assert_tensor_close("nan", nan.clone(), nan)
    with pytest.raises(AssertionError, match="max abs error inf"):
        assert_tensor_close("nan", torch.tensor([1.0, 2.0]), nan)
    with pytest.raises(AssertionError, match="torch.float64 .* instead of torch.float32"):
        assert_tensor_close("w", torch.zeros(2, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(AssertionError, match=r"missing \['b'\], unexpected \['c'\]"):
        assert_tensors_close({"a": nan, "c": nan}, {"a": nan, "b": nan})
    with pytest.raises(AssertionError, match="no tolerance for torch.float16"):
        half = torch.ones(2, dtype=torch.float16)
        assert_tensor_close("h", half, half)
