"""OpenVLA-style action tokens: each action value in [-1, 1] -> one of `num_bins` uniform bins -> a token id.

Bins map onto the top of the vocabulary, below `reserved_tail_tokens` special ids that stay untouched
(PaliGemma's last 128): bin b -> id = vocab_size - 1 - reserved_tail_tokens - b. So bin 0 (action -1)
takes the highest id and the bins occupy [first_token_id, first_token_id + num_bins).
"""

from __future__ import annotations

from torch import Tensor


class ActionTokenizer:
    """Bins <-> token ids. Decoding returns bin centres, so the round-trip error is at most 1 / num_bins."""

    def __init__(self, *, vocab_size: int, num_bins: int = 256, reserved_tail_tokens: int = 128) -> None:
        if num_bins < 2:
            raise ValueError(f"num_bins must be >= 2, got {num_bins}")
        self.vocab_size = vocab_size
        self.num_bins = num_bins
        self.reserved_tail_tokens = reserved_tail_tokens
        self.last_token_id = vocab_size - 1 - reserved_tail_tokens  # bin 0
        self.first_token_id = self.last_token_id - num_bins + 1  # bin num_bins - 1
        if self.first_token_id < 0:
            raise ValueError(
                f"vocab_size {vocab_size} cannot hold {num_bins} bins above "
                f"{reserved_tail_tokens} reserved ids"
            )

    def bins(self, actions: Tensor) -> Tensor:
        """Actions (any shape, expected in [-1, 1]; clamped) -> bin indices int64 in [0, num_bins)."""
        scaled = (actions.float().clamp(-1.0, 1.0) + 1.0) * (self.num_bins / 2.0)
        return scaled.floor().long().clamp(0, self.num_bins - 1)

    def encode(self, actions: Tensor) -> Tensor:
        """Actions -> token ids int64, same shape."""
        return self.last_token_id - self.bins(actions)

    def bin_centers(self, bins: Tensor) -> Tensor:
        return (bins.float() + 0.5) * (2.0 / self.num_bins) - 1.0

    def decode(self, token_ids: Tensor) -> Tensor:
        """Token ids -> actions (float32 bin centres). Ids outside the action range raise ValueError."""
        bins = self.last_token_id - token_ids.long()
        if bool(((bins < 0) | (bins >= self.num_bins)).any()):
            raise ValueError(
                "token ids outside the action range "
                f"[{self.first_token_id}, {self.last_token_id}] cannot be decoded"
            )
        return self.bin_centers(bins)

    def is_action_token(self, token_ids: Tensor) -> Tensor:
        return (token_ids >= self.first_token_id) & (token_ids <= self.last_token_id)
