"""Comparing tensors PyTorch computed on another machine: floats within a tolerance per dtype,
everything else exactly.

PyTorch's float results differ in the last bits between CPU models: kernels pick their
vectorisation (and the summation order that comes with it) by CPU capability, and MKL picks its
GEMM code by vendor. That holds for the reference loss and gradients and for the zoo's seeded
weights too: `torch.randn` computes its normal samples with vectorised log/sin/cos, and
`ATEN_CPU_CAPABILITY=default` (the scalar kernels) draws other bits from the same generator
state. Integer and bool tensors (token ids, labels from `torch.randint`) involve no float
arithmetic and must be equal.
"""

from __future__ import annotations

import torch

# (rtol, atol) per float dtype: each element must satisfy
# |actual - expected| <= atol + rtol * |expected|.
# - float32: torch.testing's atol, and an rtol of ~840 ULPs instead of its ~11, since a gradient
#   is the result of dozens of reductions, each summed in a kernel-dependent order. Between the
#   CPU kernel paths (AVX-512, AVX2, scalar) the zoo's single-rank references differ by up to
#   1.1e-6 absolute (a weight of scale 1), 4.1% of this allowance.
# - bfloat16 keeps 8 significant bits: four ULPs at the coarse end of a binade (2**-5), and an
#   atol a hundred times float32's.
# A float dtype without an entry fails the comparison, asking for one.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2.0**-5, 1e-3),
}


def assert_tensor_close(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """`actual` equals `expected` (same dtype and shape) within `TOLERANCES` for float dtypes,
    exactly otherwise; the failure names the tensor and its largest errors."""
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (
        f"{name}: {actual.dtype} {tuple(actual.shape)} instead of "
        f"{expected.dtype} {tuple(expected.shape)}"
    )
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{name}: {expected.dtype} values differ"
        return
    assert expected.dtype in TOLERANCES, f"{name}: no tolerance for {expected.dtype} in TOLERANCES"
    rtol, atol = TOLERANCES[expected.dtype]
    close = torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return
    # NaN where only one side is NaN counts as an infinite error.
    error = (actual.double() - expected.double()).abs().nan_to_num(nan=float("inf"))
    relative = torch.where(error == 0, 0.0, error / expected.double().abs())
    worst = int(error.flatten().argmax())
    raise AssertionError(
        f"{name}: {int((~close).sum())} of {close.numel()} {expected.dtype} elements differ "
        f"beyond rtol={rtol:g}, atol={atol:g}: max abs error {error.max().item():.3g} "
        f"(flat index {worst}: {actual.flatten()[worst].item():.9g} instead of "
        f"{expected.flatten()[worst].item():.9g}), max rel error {relative.max().item():.3g}"
    )


def assert_tensors_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    """Same keys, and every tensor close to its expected one (`assert_tensor_close`)."""
    assert sorted(actual) == sorted(expected), (
        f"missing {sorted(expected.keys() - actual.keys())}, "
        f"unexpected {sorted(actual.keys() - expected.keys())}"
    )
    for name in sorted(expected):
        assert_tensor_close(name, actual[name], expected[name])
