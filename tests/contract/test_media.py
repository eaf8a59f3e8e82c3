"""The layout compile records for an image input when the user gives no --layout."""

from __future__ import annotations

import pytest

from tandoor_contract import media


@pytest.mark.parametrize("shape,want", [
    ([1, 3, 224, 224], "NCHW"), ([1, 224, 224, 3], "NHWC"), ([1, 48, 48, 3], "NHWC"),
    ([1, 1, 64, 256], "NCHW"), ([1, 64, 256, 1], "NHWC"),
    ([1, 320, 320, 4], "NHWC"),    # M-LSD's RGBA input (tf2onnx); taken for 320 channels before
    ([1, 4, 320, 320], "NCHW"), ([1, 3, 3, 3], "NCHW"),
])
def test_the_layout_guess_knows_grey_rgb_and_rgba(shape, want):
    assert media.guess_layout(shape) == want
