"""pi0_tiny: loss, gradients, freezing, padding, the cached sampler, checkpointing, bf16 and input errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _policy_batches import make_batch
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer

from vla.models import Pi0Policy, Policy, build_policy
from vla.models.masks import make_attention_mask, positions_from_pad_mask
from vla.types import Batch


@pytest.fixture
def policy() -> Pi0Policy:
    return build_policy("pi0_tiny")


def _fixed_flow(batch: Batch, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, h, a = batch.actions.shape
    return {"noise": torch.randn(b, h, a, generator=g), "time": torch.rand(b, generator=g) * 0.9 + 0.05}


def _trainable_without_grad(policy: torch.nn.Module) -> list[str]:
    return [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None]


def test_contract_and_shapes(policy: Pi0Policy) -> None:
    assert isinstance(policy, Policy)
    batch = make_batch(policy.config, 3, prompt_lengths=[6, 2, 0], missing_camera="wrist", padded_steps=3)
    loss, metrics = policy.compute_loss(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss", "action_l1"}
    assert all(m.ndim == 0 and not m.requires_grad for m in metrics.values())
    loss.backward()
    assert _trainable_without_grad(policy) == []
    actions = policy.sample_actions(batch.observation)
    assert actions.shape == (3, policy.config.action_horizon, policy.config.max_action_dim)
    assert torch.isfinite(actions).all()


def test_dead_last_layer_weights_are_frozen_but_kept(policy: Pi0Policy) -> None:
    frozen = sorted(n for n, p in policy.named_parameters() if not p.requires_grad)
    last = f"layers.{policy.config.vlm.depth - 1}.vlm."
    assert frozen == sorted(
        [
            f"{last}self_attn.q_proj.weight",
            f"{last}self_attn.o_proj.weight",
            f"{last}mlp.gate_proj.weight",
            f"{last}mlp.up_proj.weight",
            f"{last}mlp.down_proj.weight",
            f"{last}post_attention_layernorm.weight",
            "vlm_norm.weight",
        ]
    )
    # The last layer's prefix keys/values still matter (actions attend to them): trainable.
    assert policy.layers[-1].vlm.self_attn.k_proj.weight.requires_grad
    assert policy.layers[-1].vlm.input_layernorm.weight.requires_grad


@pytest.mark.parametrize(
    ("overrides", "frozen_prefixes"),
    [
        ({"freeze_vision_tower": True}, ("prefix_embedder.vision_tower.",)),
        ({"train_expert_only": True}, ("prefix_embedder.", "layers.0.vlm.", "layers.1.vlm.")),
    ],
)
def test_freezing_options(overrides: dict, frozen_prefixes: tuple[str, ...]) -> None:
    policy = build_policy("pi0_tiny", **overrides)
    for name, p in policy.named_parameters():
        if name.startswith(frozen_prefixes):
            assert not p.requires_grad, name
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any(n.startswith("layers.0.expert.") for n in trainable)
    assert "action_out_proj.weight" in trainable
    if overrides.get("train_expert_only"):
        assert not any(".vlm." in n or n.startswith("prefix_embedder.") for n in trainable)
    loss, _ = policy.compute_loss(make_batch(policy.config))
    loss.backward()
    assert _trainable_without_grad(policy) == []


def test_loss_is_mse_over_real_dims_of_real_steps(policy: Pi0Policy) -> None:
    batch = make_batch(policy.config, 2, real_action_dims=3, padded_steps=4)
    flow = _fixed_flow(batch)
    loss, _ = policy.compute_loss(batch, **flow)
    t = flow["time"][:, None, None]
    x_t = t * flow["noise"] + (1 - t) * batch.actions
    with torch.no_grad():
        velocity = policy._velocity(batch.observation, x_t, flow["time"])
    error = (velocity - (flow["noise"] - batch.actions)).square()
    # Each sample's mean over its own real steps and dims, then the mean over samples (split-invariant).
    expected = (error[0, :-4, :3].mean() + error[1, :, :3].mean()) / 2
    torch.testing.assert_close(loss.detach(), expected)


def test_padding_and_missing_cameras_do_not_leak(policy: Pi0Policy) -> None:
    batch = make_batch(policy.config, 2, prompt_lengths=[5, 3], missing_camera="wrist", padded_steps=2)
    flow = _fixed_flow(batch)
    reference, _ = policy.compute_loss(batch, **flow)

    # Other ids under the prompt padding and another image for the masked camera must not change the loss.
    # (Padded action steps are still inputs, as in openpi: the data pipeline repeats the last action there;
    # only their error is left out, see test_loss_is_mse_over_real_dims_of_real_steps.)
    obs = dataclasses.replace(batch.observation)
    obs.tokenized_prompt = obs.tokenized_prompt.masked_fill(~obs.tokenized_prompt_mask, 77)
    obs.images = {**obs.images, "wrist": torch.rand_like(obs.images["wrist"])}
    loss, _ = policy.compute_loss(dataclasses.replace(batch, observation=obs), **flow)
    torch.testing.assert_close(loss, reference)

    # A present camera and a real prompt token do change it.
    seen = make_batch(policy.config, 2, prompt_lengths=[5, 3], missing_camera="wrist", padded_steps=2)
    seen.observation.images["top"] = torch.rand_like(seen.observation.images["top"])
    assert not torch.allclose(policy.compute_loss(seen, **flow)[0], reference)


def test_model_mask_blocks_prefix_from_suffix(policy: Pi0Policy) -> None:
    prefix_pad = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pad, ar = policy.sequence_masks(prefix_pad)
    mask = make_attention_mask(pad, ar)
    horizon = policy.config.action_horizon
    assert mask.shape == (2, 4 + 1 + horizon, 4 + 1 + horizon)
    prefix, state, actions = slice(0, 4), 4, slice(5, 5 + horizon)
    assert not mask[:, prefix, state:].any()  # the prefix sees neither state nor actions
    assert torch.equal(mask[:, state, prefix], prefix_pad)  # the state sees the real prefix and itself
    assert mask[:, state, state].all() and not mask[:, state, actions].any()
    assert torch.equal(mask[:, actions, prefix], prefix_pad[:, None, :].expand(2, horizon, 4))
    assert mask[:, actions, state:].all()  # actions see the state and every action


def test_cached_sampler_equals_uncached_reference(policy: Pi0Policy) -> None:
    batch = make_batch(policy.config, 3, prompt_lengths=[6, 1, 4], missing_camera="top")
    noise = torch.randn(3, policy.config.action_horizon, policy.config.max_action_dim)
    fast = policy.sample_actions(batch, noise=noise)
    slow = policy._sample_actions_uncached(batch, noise=noise)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fast, noise)  # the integration did move
    # num_steps changes the result (and the same noise gives the same actions)
    torch.testing.assert_close(policy.sample_actions(batch, noise=noise), fast)
    assert not torch.allclose(policy.sample_actions(batch, noise=noise, num_steps=3), fast)


def test_joint_layer_on_one_stream_equals_gemma_decoder_layer(policy: Pi0Policy) -> None:
    """Without the other stream, the pair must compute exactly transformers' GemmaDecoderLayer."""
    pair = policy.layers[0]
    for layer, width, as_prefix in ((pair.vlm, policy.config.vlm.width, True), (pair.expert, 32, False)):
        hidden = torch.randn(2, 7, width)
        pad = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
        mask = make_attention_mask(pad, torch.tensor([0, 0, 1, 0, 1, 1, 0], dtype=torch.bool))[:, None]
        cos, sin = policy.rotary_emb(hidden, positions_from_pad_mask(pad))
        args = (hidden, None) if as_prefix else (None, hidden)
        prefix_out, suffix_out, _ = pair(*args, cos=cos, sin=sin, attention_mask=mask)
        ours = prefix_out if as_prefix else suffix_out
        assert isinstance(layer, GemmaDecoderLayer)
        theirs = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin))
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_adamw_lowers_loss_on_fixed_batch() -> None:
    torch.manual_seed(0)
    policy = build_policy("pi0_tiny")
    batch = make_batch(policy.config, 2)
    flow = _fixed_flow(batch)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(25):
        loss, _ = policy.compute_loss(batch, **flow)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], losses


def test_gradient_checkpointing_matches_plain_backward() -> None:
    plain = build_policy("pi0_tiny")
    checkpointed = build_policy("pi0_tiny", gradient_checkpointing=True)
    checkpointed.load_state_dict(plain.state_dict())
    assert all(layer.gradient_checkpointing for layer in checkpointed.shard_units())
    batch = make_batch(plain.config)
    flow = _fixed_flow(batch)
    for model in (plain, checkpointed):
        model.compute_loss(batch, **flow)[0].backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
    checkpointed.set_gradient_checkpointing(False)
    assert not any(layer.gradient_checkpointing for layer in checkpointed.shard_units())


def test_bf16_autocast(policy: Pi0Policy) -> None:
    batch = make_batch(policy.config)
    flow = _fixed_flow(batch)
    fp32_loss, _ = policy.compute_loss(batch, **flow)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = policy.compute_loss(batch, **flow)
        actions = policy.sample_actions(batch, noise=flow["noise"], num_steps=2)
    assert loss.dtype == torch.float32 and actions.dtype == torch.float32
    assert loss.item() == pytest.approx(fp32_loss.item(), rel=0.05)
    loss.backward()
    assert _trainable_without_grad(policy) == []
    assert all(p.dtype == torch.float32 for p in policy.parameters())


def test_shard_units_cover_layer_pairs_and_vision_layers(policy: Pi0Policy) -> None:
    units = policy.shard_units()
    config = policy.config
    assert len(units) == config.vlm.depth + config.vision.depth
    pair_params = {id(p) for p in units[0].parameters()}
    assert {id(p) for p in policy.layers[0].vlm.parameters()} <= pair_params
    assert {id(p) for p in policy.layers[0].expert.parameters()} <= pair_params


def test_bad_inputs_raise_clear_errors(policy: Pi0Policy) -> None:
    batch = make_batch(policy.config)
    del batch.observation.images["wrist"]
    with pytest.raises(ValueError, match=r"observation.images: missing camera\(s\) \['wrist'\]"):
        policy.compute_loss(batch)

    batch = make_batch(policy.config)
    batch.observation.images["top"] = batch.observation.images["top"][:, :, :20, :20]
    with pytest.raises(ValueError, match=r"images\['top'\].*expected shape \(2, 3, 28, 28\)"):
        policy.compute_loss(batch)

    batch = make_batch(policy.config)
    batch.observation.state = batch.observation.state[:, :7]
    with pytest.raises(ValueError, match=r"observation.state.*max_state_dim=32"):
        policy.sample_actions(batch)

    batch = make_batch(policy.config)
    batch.observation.tokenized_prompt[0, 0] = policy.config.vocab_size
    with pytest.raises(ValueError, match=r"tokenized_prompt: token ids must lie in \[0, 1024\)"):
        policy.compute_loss(batch)

    batch = make_batch(policy.config)
    batch.actions = batch.actions[:, :5]
    with pytest.raises(ValueError, match=r"batch.actions.*action_horizon=10"):
        policy.compute_loss(batch)

    with pytest.raises(ValueError, match="noise must be"):
        policy.sample_actions(make_batch(policy.config), noise=torch.zeros(2, 3, 32))


def test_calling_the_policy_is_compute_loss() -> None:
    """DDP / FSDP2 wrappers hook __call__: model(batch) must be the training objective."""
    from vla.models import build_policy

    policy = build_policy("pi0_tiny")
    batch = make_batch(policy.config, 2)
    noise = torch.randn_like(batch.actions)
    time = torch.full((2,), 0.5)
    called, _ = policy(batch, noise=noise, time=time)
    direct, _ = policy.compute_loss(batch, noise=noise, time=time)
    assert torch.equal(called, direct)


def test_use_state_false_ignores_the_state_and_keeps_its_weight_at_zero() -> None:
    torch.manual_seed(0)
    policy = build_policy("pi0_tiny", use_state=False)
    assert not policy.state_proj.weight.requires_grad
    assert policy.state_proj.weight.abs().max() == 0 and policy.state_proj.bias.requires_grad
    batch = make_batch(policy.config, 2)
    other_state = dataclasses.replace(batch.observation, state=batch.observation.state + 3.0)
    other = dataclasses.replace(batch, observation=other_state)
    flow = _fixed_flow(batch)
    noise = torch.randn(2, policy.config.action_horizon, policy.config.max_action_dim)
    torch.testing.assert_close(
        policy.compute_loss(batch, **flow)[0], policy.compute_loss(other, **flow)[0], rtol=0, atol=0
    )
    torch.testing.assert_close(
        policy.sample_actions(batch.observation, noise=noise),
        policy.sample_actions(other_state, noise=noise),
        rtol=0,
        atol=0,
    )
    # The default reads it: the same change of state changes the loss.
    reading = build_policy("pi0_tiny")
    assert reading.compute_loss(batch, **flow)[0] != reading.compute_loss(other, **flow)[0]
    # Training moves the state token's bias but never the weight, which the export carries as zeros.
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    bias = policy.state_proj.bias.detach().clone()
    for _ in range(3):
        loss, _ = policy.compute_loss(batch, **flow)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert policy.state_proj.weight.abs().max() == 0
    assert not torch.equal(policy.state_proj.bias, bias)
    with pytest.raises(ValueError, match="use_state must be true or false"):
        build_policy("pi0_tiny", use_state="no")
