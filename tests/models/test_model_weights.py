"""Checkpoint loading/saving in the LeRobot pi0 and transformers PaliGemma layouts, on tiny checkpoints."""

from __future__ import annotations

import re

import pytest
import torch
from _policy_batches import make_batch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import GemmaForCausalLM, PaliGemmaConfig, PaliGemmaForConditionalGeneration

from vla.models import Pi0Config, Pi0Policy, build_policy
from vla.models.paligemma import gemma_config, init_non_persistent_buffers, siglip_config
from vla.models.weights import (
    CheckpointMismatchError,
    load_paligemma_weights,
    load_pi0_weights,
    save_paligemma_weights,
    save_pi0_weights,
)


def _paligemma(config: Pi0Config) -> PaliGemmaForConditionalGeneration:
    text = gemma_config(
        config.vlm,
        vocab_size=config.vocab_size,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
    )
    return PaliGemmaForConditionalGeneration(
        PaliGemmaConfig(
            vision_config=siglip_config(config.vision).to_dict(),
            text_config=text.to_dict(),
            projection_dim=config.vlm.width,
            hidden_size=config.vlm.width,
            image_token_id=config.vocab_size,
        )
    )


def _lerobot_like_pi0(config: Pi0Config) -> nn.Module:
    """A module tree shaped like LeRobot's PI0Policy, built from transformers' own PaliGemma and Gemma."""
    expert_config = gemma_config(
        config.expert,
        vocab_size=config.vocab_size,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
    )
    root = nn.Module()
    root.model = nn.Module()
    root.model.paligemma_with_expert = nn.Module()
    root.model.paligemma_with_expert.paligemma = _paligemma(config)
    expert = GemmaForCausalLM(expert_config)
    expert.model.embed_tokens = None  # LeRobot drops the expert's input embedding and keeps its lm_head
    root.model.paligemma_with_expert.gemma_expert = expert
    width = config.expert.width
    root.model.state_proj = nn.Linear(config.max_state_dim, width)
    root.model.action_in_proj = nn.Linear(config.max_action_dim, width)
    root.model.action_out_proj = nn.Linear(width, config.max_action_dim)
    root.model.action_time_mlp_in = nn.Linear(2 * width, width)
    root.model.action_time_mlp_out = nn.Linear(width, width)
    return root


def _lerobot_state_dict(reference: nn.Module) -> dict[str, torch.Tensor]:
    """Its state dict with the parameter names LeRobot's checkpoints have (transformers 4.5x nesting)."""
    out = {}
    for key, value in reference.state_dict().items():
        # transformers 4.x kept SiglipVisionModel's parameters under an inner `vision_model`.
        key = key.replace(".vision_tower.", ".vision_tower.vision_model.")
        out[key] = value.detach().clone()
    return out


def test_lerobot_layout_checkpoint_loads_and_exports_back(tmp_path) -> None:
    config = build_policy("pi0_tiny").config
    reference = _lerobot_like_pi0(config)
    written = _lerobot_state_dict(reference)
    save_file(written, str(tmp_path / "model.safetensors"))

    policy = Pi0Policy(config)
    report = load_pi0_weights(policy, tmp_path)
    assert report.left_initialised == []
    assert set(report.ignored) == {
        "model.paligemma_with_expert.paligemma.lm_head.weight",
        "model.paligemma_with_expert.gemma_expert.lm_head.weight",
    }
    pwe = reference.model.paligemma_with_expert
    assert torch.equal(
        policy.layers[1].expert.mlp.down_proj.weight, pwe.gemma_expert.model.layers[1].mlp.down_proj.weight
    )
    assert torch.equal(
        policy.layers[0].vlm.self_attn.k_proj.weight,
        pwe.paligemma.model.language_model.layers[0].self_attn.k_proj.weight,
    )
    assert torch.equal(policy.expert_norm.weight, pwe.gemma_expert.model.norm.weight)
    assert torch.equal(policy.action_time_mlp_in.bias, reference.model.action_time_mlp_in.bias)

    # The prefix embeddings equal transformers' PaliGemma image features and token embeddings.
    batch = make_batch(config, 2)
    with torch.no_grad():
        prefix, _ = policy.prefix_embedder(batch.observation, config.cameras)
        per_image = config.vision.tokens_per_image
        theirs_image = pwe.paligemma.model.get_image_features(batch.observation.images["top"]).pooler_output
        theirs_text = pwe.paligemma.model.language_model.embed_tokens(batch.observation.tokenized_prompt)
    torch.testing.assert_close(prefix[:, :per_image], theirs_image)
    torch.testing.assert_close(prefix[:, 2 * per_image :], theirs_text)

    # Exporting writes exactly LeRobot's key set, with the same tensors.
    exported = load_file(str(save_pi0_weights(policy, tmp_path / "export.safetensors")))
    assert sorted(exported) == sorted(written)
    for key, value in written.items():
        assert torch.equal(exported[key], value) or key.endswith("gemma_expert.lm_head.weight"), key


def test_round_trip_in_both_prefixes_and_older_spellings(tmp_path) -> None:
    source, target = build_policy("pi0_tiny"), build_policy("pi0_tiny")
    batch = make_batch(source.config)
    noise = torch.randn(2, source.config.action_horizon, source.config.max_action_dim)
    expected = source.sample_actions(batch, noise=noise)

    openpi_file = save_pi0_weights(source, tmp_path / "openpi", lerobot_prefix=False, write_unused_keys=False)
    assert not any(k.startswith("model.") for k in load_file(str(openpi_file)))
    load_pi0_weights(target, openpi_file)
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(target.sample_actions(batch, noise=noise), expected)

    # transformers < 4.52 nesting and the early `time_mlp_*` names load too.
    old = {}
    for key, value in load_file(str(save_pi0_weights(source, tmp_path / "lerobot"))).items():
        key = key.replace("paligemma.model.language_model.", "paligemma.language_model.model.")
        key = key.replace("paligemma.model.vision_tower.", "paligemma.vision_tower.")
        key = re.sub(r"^model\.action_time_mlp_", "model.time_mlp_", key)
        old[key] = value
    assert any(".language_model.model." in k for k in old) and "model.time_mlp_in.weight" in old
    save_file(old, str(tmp_path / "old.safetensors"))
    fresh = build_policy("pi0_tiny")
    load_pi0_weights(fresh, tmp_path / "old.safetensors")
    torch.testing.assert_close(fresh.sample_actions(batch, noise=noise), expected)


def test_mismatches_are_listed_in_one_error(tmp_path) -> None:
    source = build_policy("pi0_tiny")
    tensors = load_file(str(save_pi0_weights(source, tmp_path / "ok.safetensors")))
    dropped = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"
    del tensors[dropped]
    tensors["model.paligemma_with_expert.gemma_expert.model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "broken.safetensors"))
    with pytest.raises(CheckpointMismatchError) as caught:
        load_pi0_weights(build_policy("pi0_tiny"), tmp_path / "broken.safetensors")
    error = caught.value
    assert error.missing == [dropped.removeprefix("model.")]
    assert error.unexpected == ["model.paligemma_with_expert.gemma_expert.model.layers.9.mlp.up_proj.weight"]
    assert "1 missing keys" in str(error) and "1 unexpected keys" in str(error)

    wider = build_policy("pi0_tiny", expert={"width": 48})
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatches") as caught:
        load_pi0_weights(wider, tmp_path / "ok.safetensors")
    assert any("state_proj.weight: (32, 32) vs (48, 32)" in line for line in caught.value.shape_mismatches)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_pi0_weights(wider, tmp_path / "nope.safetensors")


def test_paligemma_checkpoint_into_pi0_leaves_expert_initialised(tmp_path) -> None:
    config = build_policy("pi0_tiny").config
    reference = _paligemma(config)
    reference.save_pretrained(tmp_path)
    policy = Pi0Policy(config)
    expert_before = policy.layers[0].expert.self_attn.q_proj.weight.clone()
    report = load_paligemma_weights(policy, tmp_path)
    assert "layers.0.expert.self_attn.q_proj.weight" in report.left_initialised
    assert "state_proj.weight" in report.left_initialised
    assert not any(name.startswith(("prefix_embedder.", "vlm_norm")) for name in report.left_initialised)
    assert torch.equal(policy.layers[0].expert.self_attn.q_proj.weight, expert_before)
    assert torch.equal(
        policy.layers[1].vlm.mlp.gate_proj.weight,
        reference.model.language_model.layers[1].mlp.gate_proj.weight,
    )


def test_openvla_paligemma_round_trip(tmp_path) -> None:
    source, target = build_policy("openvla_tiny"), build_policy("openvla_tiny")
    load_paligemma_weights(target, save_paligemma_weights(source, tmp_path))
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name


def test_meta_build_then_load_matches_eager_model(tmp_path) -> None:
    eager = build_policy("pi0_tiny")
    file = save_pi0_weights(eager, tmp_path)
    with torch.device("meta"):
        lazy = build_policy("pi0_tiny")
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    load_pi0_weights(lazy, file)
    init_non_persistent_buffers(lazy)
    # requires_grad survives the load (the dead last-layer weights stay frozen)
    assert [n for n, p in lazy.named_parameters() if not p.requires_grad] == [
        n for n, p in eager.named_parameters() if not p.requires_grad
    ]
    batch = make_batch(eager.config)
    noise = torch.randn(2, eager.config.action_horizon, eager.config.max_action_dim)
    torch.testing.assert_close(
        lazy.sample_actions(batch, noise=noise), eager.sample_actions(batch, noise=noise)
    )
