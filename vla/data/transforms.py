"""Image transforms to the model's input: resize with padding to R x R, then [0, 1] -> [-1, 1].

Follows openpi: keep the aspect ratio, resize so the longer side is R (bilinear, antialiased when
shrinking), pad the rest symmetrically with black (0 in [0, 1], hence -1 after scaling).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def resized_hw(height: int, width: int, size: int) -> tuple[int, int]:
    """(h, w) after scaling the longer side to `size`, keeping the aspect ratio."""
    ratio = max(height / size, width / size)
    return max(1, round(height / ratio)), max(1, round(width / ratio))


def resize_with_pad(images: Tensor, size: int) -> Tensor:
    """(..., C, H, W) -> (..., C, size, size): resized, then padded with 0 around it. Keeps the dtype.

    float input is expected in [0, 1]; uint8 input is resized natively (torch's uint8 bilinear kernel,
    within one level of the float path and ~2x faster), which keeps uint8 transport cheap.
    """
    *lead, channels, height, width = images.shape
    if (height, width) == (size, size):
        return images
    x = images.reshape(-1, channels, height, width)
    new_h, new_w = resized_hw(height, width, size)
    if (new_h, new_w) != (height, width):
        shrinking = new_h < height or new_w < width
        if x.dtype not in (torch.uint8, torch.float32, torch.float64):
            x = x.to(torch.float32)
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=shrinking)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    x = F.pad(x, (left, size - new_w - left, top, size - new_h - top), value=0)
    return x.to(images.dtype).reshape(*lead, channels, size, size)


def to_model_range(images: Tensor) -> Tensor:
    """uint8 0..255 or float [0, 1] -> float32 [-1, 1]."""
    if images.dtype == torch.uint8:
        return images.to(torch.float32).mul_(2.0 / 255.0).sub_(1.0)
    return images.to(torch.float32) * 2.0 - 1.0
