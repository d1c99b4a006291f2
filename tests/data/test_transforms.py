"""resize_with_pad keeps the aspect ratio and pads with black, which becomes -1 in model range."""

from __future__ import annotations

import torch

from vla.data import resize_with_pad, to_model_range
from vla.data.transforms import resized_hw


def test_wide_image_is_padded_top_and_bottom() -> None:
    image = torch.full((2, 3, 32, 64), 0.5)
    out = resize_with_pad(image, 48)
    assert out.shape == (2, 3, 48, 48)
    assert resized_hw(32, 64, 48) == (24, 48)
    assert torch.all(out[:, :, 12:36] == 0.5)
    assert torch.all(out[:, :, :12] == 0) and torch.all(out[:, :, 36:] == 0)
    model = to_model_range(out)
    assert torch.all(model[:, :, :12] == -1.0) and torch.allclose(model[:, :, 20], torch.tensor(0.0))


def test_tall_image_is_padded_left_and_right_and_upscaled() -> None:
    image = torch.rand(3, 20, 10)
    out = resize_with_pad(image, 64)
    assert out.shape == (3, 64, 64)
    assert torch.all(out[:, :, :16] == 0) and torch.all(out[:, :, 48:] == 0)
    assert out[:, :, 16:48].mean() > 0.3


def test_uint8_path_matches_float_path_and_same_size_is_untouched() -> None:
    image = torch.randint(0, 256, (4, 3, 30, 40), dtype=torch.uint8)
    as_uint8 = resize_with_pad(image, 56)
    as_float = resize_with_pad(image.float() / 255.0, 56)
    assert as_uint8.dtype == torch.uint8
    assert (as_uint8.float() / 255.0 - as_float).abs().max() <= 1.5 / 255.0  # uint8 kernel: within a level
    torch.testing.assert_close(to_model_range(as_uint8), as_float * 2 - 1, atol=3.0 / 255.0, rtol=0)
    same = torch.rand(3, 16, 16)
    assert resize_with_pad(same, 16) is same
