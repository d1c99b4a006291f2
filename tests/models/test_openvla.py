"""OpenVLA-style tiny policy: loss, gradients, greedy decoding, action dims, and parity with transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _policy_batches import make_batch
from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

from vla.models import OpenVLAPolicy, Policy, build_policy
from vla.models.masks import make_attention_mask, positions_from_pad_mask
from vla.models.paligemma import gemma_config, siglip_config
from vla.models.weights import load_paligemma_weights


@pytest.fixture
def policy() -> OpenVLAPolicy:
    return build_policy("openvla_tiny")


def test_contract_shapes_and_gradients(policy: OpenVLAPolicy) -> None:
    assert isinstance(policy, Policy)
    batch = make_batch(policy.config, 3, prompt_lengths=[6, 2, 0], missing_camera="top", padded_steps=1)
    loss, metrics = policy.compute_loss(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss", "token_accuracy", "l1"}
    assert 0.0 <= metrics["token_accuracy"].item() <= 1.0
    loss.backward()
    assert [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None] == []
    actions = policy.sample_actions(batch)
    assert actions.shape == (3, policy.config.action_horizon, policy.config.max_action_dim)
    assert torch.all(actions[:, :, 3:] == 0)  # only the 3 real dims are written
    assert float(actions[:, :, :3].abs().max()) <= 1.0


def test_frozen_vision_tower() -> None:
    policy = build_policy("openvla_tiny", freeze_vision_tower=True)
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    assert frozen == {
        n for n, _ in policy.named_parameters() if n.startswith("prefix_embedder.vision_tower.")
    }
    policy.compute_loss(make_batch(policy.config))[0].backward()
    assert [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None] == []


def test_greedy_decoding_reproduces_teacher_forced_argmax(policy: OpenVLAPolicy) -> None:
    """The cached decoder's tokens, fed back with teacher forcing, are each step's argmax again."""
    batch = make_batch(policy.config, 2, prompt_lengths=[6, 3], missing_camera="wrist")
    decoded = policy.sample_actions(batch)
    replay = dataclasses.replace(batch, actions=decoded)
    _, metrics = policy.compute_loss(replay)
    assert metrics["token_accuracy"].item() == 1.0
    assert metrics["l1"].item() == pytest.approx(0.0, abs=1e-6)


def test_cross_entropy_only_on_action_tokens_of_real_steps(policy: OpenVLAPolicy) -> None:
    batch = make_batch(policy.config, 2, prompt_lengths=[5, 2], missing_camera="wrist", padded_steps=1)
    reference, _ = policy.compute_loss(batch)
    obs = dataclasses.replace(batch.observation)
    obs.tokenized_prompt = obs.tokenized_prompt.masked_fill(~obs.tokenized_prompt_mask, 99)
    obs.images = {**obs.images, "wrist": torch.rand_like(obs.images["wrist"])}
    actions = batch.actions.clone()
    actions[0, -1] = -actions[0, -1]  # the last step of sample 0 is padding: its tokens carry no loss
    loss, _ = policy.compute_loss(dataclasses.replace(batch, observation=obs, actions=actions))
    torch.testing.assert_close(loss, reference)


def test_adamw_fits_a_fixed_batch_and_decodes_it() -> None:
    torch.manual_seed(0)
    policy = build_policy("openvla_tiny")
    batch = make_batch(policy.config, 2, real_action_dims=2)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = policy.compute_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], losses
    decoded = policy.sample_actions(batch)
    assert float((decoded - batch.actions).abs().mean()) < 0.05


def test_action_dims_come_from_the_batch_or_the_config(policy: OpenVLAPolicy) -> None:
    batch = make_batch(policy.config, 2)
    with pytest.raises(ValueError, match=r"needs OpenVLAConfig\.action_dim"):
        policy.sample_actions(batch.observation)
    fixed = build_policy("openvla_tiny", action_dim=3)
    actions = fixed.sample_actions(batch.observation)
    assert torch.all(actions[:, :, 3:] == 0)
    mixed = make_batch(policy.config, 2)
    mixed.action_dim_mask[1, 2] = False
    with pytest.raises(ValueError, match="action_dim_mask differs between samples"):
        policy.compute_loss(mixed)
    wrong = build_policy("openvla_tiny", action_dim=2)
    with pytest.raises(ValueError, match=r"marks dims \[0, 1, 2\] but OpenVLAConfig.action_dim=2"):
        wrong.compute_loss(batch)


def test_prompt_ids_may_not_collide_with_action_bins(policy: OpenVLAPolicy) -> None:
    batch = make_batch(policy.config)
    batch.observation.tokenized_prompt[0, 0] = policy.config.first_action_token_id
    with pytest.raises(ValueError, match="real ones below 640"):
        policy.compute_loss(batch)
    with pytest.raises(ValueError, match="not a flow model"):
        policy.compute_loss(make_batch(policy.config), noise=torch.zeros(1))


def test_bf16_autocast_and_checkpointing(policy: OpenVLAPolicy) -> None:
    batch = make_batch(policy.config)
    policy.set_gradient_checkpointing(True)
    policy.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = policy.compute_loss(batch)
        actions = policy.sample_actions(batch)
    loss.backward()
    assert torch.isfinite(loss) and actions.dtype == torch.float32
    assert [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None] == []


def test_logits_match_transformers_paligemma(tmp_path) -> None:
    """Our prefix-LM pass equals transformers' PaliGemmaForConditionalGeneration with the same weights."""
    config = build_policy("openvla_tiny").config.replace(cameras=("top",))
    vocab = config.vocab_size
    text = gemma_config(
        config.vlm, vocab_size=vocab, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps
    )
    reference = PaliGemmaForConditionalGeneration(
        PaliGemmaConfig(
            vision_config=siglip_config(config.vision).to_dict(),
            text_config=text.to_dict(),
            projection_dim=config.vlm.width,
            hidden_size=config.vlm.width,
            image_token_id=vocab,  # outside the text vocabulary, as in pi0's PaliGemma
        )
    ).eval()
    reference.save_pretrained(tmp_path)
    policy = OpenVLAPolicy(config)
    report = load_paligemma_weights(policy, tmp_path)
    assert report.left_initialised == []

    batch = make_batch(config, 2, prompt_len=5)
    num_image = config.vision.tokens_per_image
    suffix = torch.randint(640, 896, (2, 4))
    input_ids = torch.cat(
        [torch.full((2, num_image), vocab), batch.observation.tokenized_prompt, suffix], dim=1
    )
    token_type_ids = torch.cat(
        [torch.zeros(2, num_image + 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)], 1
    )
    positions = torch.arange(input_ids.shape[1])[None].expand(2, -1)
    with torch.no_grad():
        theirs = reference(
            input_ids=input_ids,
            pixel_values=batch.observation.images["top"],
            token_type_ids=token_type_ids,
            position_ids=positions,
        ).logits
        prefix, prefix_pad = policy.prefix_embedder(batch.observation, config.cameras)
        hidden = torch.cat([prefix, policy.prefix_embedder.embed_tokens(suffix)], dim=1)
        pad = torch.cat([prefix_pad, torch.ones(2, 4, dtype=torch.bool)], dim=1)
        ar = torch.cat([torch.zeros(prefix.shape[1], dtype=torch.bool), torch.ones(4, dtype=torch.bool)])
        ours = policy._logits(
            policy._decoder(hidden, make_attention_mask(pad, ar)[:, None], positions_from_pad_mask(pad))
        )
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
