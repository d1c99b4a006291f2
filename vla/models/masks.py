"""Attention masks and positions built from per-token pad and block flags (the openpi `ar_mask` scheme).

Every token carries two flags: `pad_mask` (True on real tokens) and `ar_mask` (True where a new attention
block starts). Token i may attend to token j iff j is real and j's block started no later than i's:
cumsum(ar_mask)[j] <= cumsum(ar_mask)[i]. So ar_mask = [0, 0, 0] is bidirectional, [1, 1, 1] causal, and
prefix 0s followed by suffix flags gives a prefix that cannot see the suffix while the suffix sees it all.
"""

from __future__ import annotations

import torch
from torch import Tensor


def make_attention_mask(pad_mask: Tensor, ar_mask: Tensor) -> Tensor:
    """Block-causal attention mask.

    Args:
        pad_mask: (B, N) bool, True on real tokens.
        ar_mask: (B, N) or (N,) bool/int, True where a token starts a new block.

    Returns:
        (B, N, N) bool; [b, i, j] True when query i may attend to key j. Every token also sees itself, so no
        query row is empty (an all-masked softmax row is NaN on some attention kernels); this only changes
        the outputs of padding tokens, which nothing reads.
    """
    if pad_mask.ndim != 2:
        raise ValueError(f"pad_mask must be (B, N), got shape {tuple(pad_mask.shape)}")
    if ar_mask.ndim == 1:
        ar_mask = ar_mask[None].expand_as(pad_mask)
    if ar_mask.shape != pad_mask.shape:
        raise ValueError(
            f"ar_mask shape {tuple(ar_mask.shape)} does not match pad_mask {tuple(pad_mask.shape)}"
        )
    blocks = torch.cumsum(ar_mask.to(torch.int64), dim=1)
    allowed = blocks[:, None, :] <= blocks[:, :, None]
    allowed = allowed & pad_mask.bool()[:, None, :]
    eye = torch.eye(pad_mask.shape[1], dtype=torch.bool, device=pad_mask.device)
    return allowed | eye


def positions_from_pad_mask(pad_mask: Tensor) -> Tensor:
    """RoPE positions (B, N) int64: real tokens are numbered 0, 1, 2, ... skipping padding."""
    return torch.cumsum(pad_mask.to(torch.int64), dim=1) - 1
