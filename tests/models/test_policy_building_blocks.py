"""Masks, positions, flow-matching helpers and the action tokenizer on their own."""

from __future__ import annotations

import math

import pytest
import torch

from vla.models.action_tokenizer import ActionTokenizer
from vla.models.flow_matching import euler_integrate, sample_flow_time, sinusoidal_time_embedding
from vla.models.masks import make_attention_mask, positions_from_pad_mask


def _pi0_layout() -> tuple[torch.Tensor, torch.Tensor]:
    # prefix: 2 image tokens, 2 prompt tokens, 1 prompt pad | suffix: state, 3 actions
    pad = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    ar = torch.tensor([0, 0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    return pad, ar


def test_block_causal_mask_on_pi0_layout() -> None:
    pad, ar = _pi0_layout()
    mask = make_attention_mask(pad, ar)[0]
    prefix, pad_col, state, actions = [0, 1, 2, 3], 4, 5, [6, 7, 8]
    real_prefix = [0, 1, 2, 3]
    # The prefix sees the real prefix only: never the state, the actions or the padding.
    for i in prefix:
        assert mask[i, real_prefix].all()
        assert not mask[i, pad_col]
        assert not mask[i, state]
        assert not mask[i, actions].any()
    # The state sees the prefix and itself, not the actions.
    assert mask[state, real_prefix].all() and mask[state, state]
    assert not mask[state, actions].any()
    # Actions see everything real, bidirectionally among themselves.
    for i in actions:
        assert mask[i, [*real_prefix, state, *actions]].all()
        assert not mask[i, pad_col]
    # Padding is never a key for others; as a query it sees its block and itself (outputs never read).
    assert mask[pad_col].tolist() == [True] * 5 + [False] * 4


def test_causal_and_bidirectional_extremes() -> None:
    pad = torch.ones(1, 4, dtype=torch.bool)
    causal = make_attention_mask(pad, torch.ones(4, dtype=torch.bool))[0]
    assert torch.equal(causal, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    full = make_attention_mask(pad, torch.zeros(4, dtype=torch.bool))[0]
    assert full.all()


def test_mask_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="ar_mask shape"):
        make_attention_mask(torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool))


def test_positions_skip_padding() -> None:
    pad, _ = _pi0_layout()
    assert positions_from_pad_mask(pad).tolist() == [[0, 1, 2, 3, 3, 4, 5, 6, 7]]


def test_euler_recovers_actions_on_straight_flow() -> None:
    """x_t = t * noise + (1 - t) * a has constant velocity (x - a) / t; Euler follows it exactly to a."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(3, 5, 4, generator=generator)
    noise = torch.randn(3, 5, 4, generator=generator)
    seen_times: list[float] = []

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen_times.append(float(t[0]))
        return (x - target) / t[:, None, None]

    result = euler_integrate(velocity, noise, num_steps=10)
    torch.testing.assert_close(result, target, atol=1e-5, rtol=0)
    assert seen_times == pytest.approx([1.0 - 0.1 * k for k in range(10)])


def test_euler_matches_closed_form_on_linear_field() -> None:
    """dx/dt = lam * x integrated from t=1 to 0 in N steps gives exactly x0 * (1 - lam / N) ** N."""
    x0 = torch.tensor([[1.0, -2.0, 0.5]])
    lam, steps = 0.7, 8
    result = euler_integrate(lambda x, t: lam * x, x0, num_steps=steps)
    torch.testing.assert_close(result, x0 * (1 - lam / steps) ** steps)
    # and it approaches the exact solution x0 * exp(-lam) as the steps shrink
    fine = euler_integrate(lambda x, t: lam * x, x0, num_steps=2000)
    torch.testing.assert_close(fine, x0 * math.exp(-lam), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="num_steps"):
        euler_integrate(lambda x, t: x, x0, num_steps=0)


def test_sinusoidal_time_embedding() -> None:
    emb = sinusoidal_time_embedding(torch.tensor([0.0, 1.0]), 8, min_period=4e-3, max_period=4.0)
    assert emb.shape == (2, 8) and emb.dtype == torch.float32
    torch.testing.assert_close(emb[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    # the longest period (4.0) at t = 1 is a quarter turn: sin = 1
    assert emb[1, 3].item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="even"):
        sinusoidal_time_embedding(torch.zeros(2), 7, min_period=4e-3, max_period=4.0)


def test_flow_time_distribution() -> None:
    torch.manual_seed(0)
    t = sample_flow_time(20000, alpha=1.5, beta=1.0, time_min=0.001, device="cpu")
    assert t.shape == (20000,) and t.dtype == torch.float32
    assert float(t.min()) >= 0.001 and float(t.max()) <= 1.0
    # Beta(1.5, 1) has mean 0.6; scaled by 0.999 and shifted by 0.001
    assert float(t.mean()) == pytest.approx(0.6 * 0.999 + 0.001, abs=0.01)


def test_action_tokenizer_round_trip_and_id_range() -> None:
    tokenizer = ActionTokenizer(vocab_size=1024, num_bins=256, reserved_tail_tokens=128)
    assert (tokenizer.first_token_id, tokenizer.last_token_id) == (640, 895)
    actions = torch.linspace(-1, 1, 10001)
    ids = tokenizer.encode(actions)
    assert int(ids.min()) == 640 and int(ids.max()) == 895  # never touches the last 128 ids
    assert torch.all(ids[1:] <= ids[:-1])  # larger action -> smaller id (bin b -> last_id - b)
    assert ids[0] == 895 and ids[-1] == 640
    decoded = tokenizer.decode(ids)
    assert float((decoded - actions).abs().max()) <= 1.0 / 256 + 1e-6
    # out-of-range actions are clamped to the edge bins
    assert tokenizer.encode(torch.tensor([-3.0, 7.0])).tolist() == [895, 640]
    with pytest.raises(ValueError, match="outside the action range"):
        tokenizer.decode(torch.tensor([639]))
    with pytest.raises(ValueError, match="cannot hold"):
        ActionTokenizer(vocab_size=300, num_bins=256, reserved_tail_tokens=128)


def test_sinusoidal_time_embedding_is_the_float64_reference_rounded_once() -> None:
    # openpi / LeRobot's create_sinusoidal_pos_embedding written out with Python floats (float64) on the
    # float32 times the model gets, then rounded to float32 once.
    time = torch.tensor([0.001, 0.25, 0.73, 0.999, 1.0], dtype=torch.float32)
    dim, min_period, max_period = 64, 4e-3, 4.0
    expected = []
    for t in time.tolist():  # the exact float32 values, as Python floats
        periods = [min_period * (max_period / min_period) ** (i / (dim // 2 - 1)) for i in range(dim // 2)]
        angles = [1.0 / p * 2 * math.pi * t for p in periods]
        expected.append([math.sin(a) for a in angles] + [math.cos(a) for a in angles])
    reference = torch.tensor(expected, dtype=torch.float64)
    emb = sinusoidal_time_embedding(time, dim, min_period=min_period, max_period=max_period)
    assert emb.dtype == torch.float32
    # Only the final rounding to float32 remains (half an ulp of values in [-1, 1]), plus linspace's own
    # float64 rounding of the period fractions.
    torch.testing.assert_close(emb, reference.float(), rtol=0, atol=1e-7)
    # float32 arithmetic (the old implementation) is far further from the reference at t near 1.
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32)
    angles32 = time[:, None] * (2.0 * math.pi / (min_period * (max_period / min_period) ** fraction))[None, :]
    old = torch.cat([torch.sin(angles32), torch.cos(angles32)], dim=1)
    assert (old.double() - reference).abs().max() > 1e-5 > 1e-7 > (emb.double() - reference).abs().max()


def test_the_pad_token_embedding_starts_at_zero_and_gets_no_gradient() -> None:
    from vla.models import build_policy
    from vla.models.paligemma import PAD_TOKEN_ID

    for name in ("pi0_tiny", "openvla_tiny"):
        embed = build_policy(name).prefix_embedder.embed_tokens
        assert embed.padding_idx == PAD_TOKEN_ID == 0
        assert torch.count_nonzero(embed.weight[0]) == 0 and torch.count_nonzero(embed.weight[1]) > 0
        tokens = torch.tensor([[5, 0, 0, 7]])
        embed(tokens).sum().backward()
        grad = embed.weight.grad
        assert torch.count_nonzero(grad[0]) == 0  # pad token: no gradient
        assert torch.count_nonzero(grad[5]) > 0 and torch.count_nonzero(grad[7]) > 0
