"""Presets, parameter counts on the meta device, build_policy's inputs, config validation, parameter roles."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    PI0Config,
    PI0ForConditionalGeneration,
)

from vla.models import (
    PRESETS,
    OpenVLAConfig,
    OpenVLAPolicy,
    Pi0Config,
    Pi0Policy,
    build_policy,
    config_from_dict,
)
from vla.models.naming import parameter_role, parameters_by_role
from vla.models.paligemma import gemma_config, siglip_config

# LeRobot logs 3,501,372,176 learnable parameters for pi0. That count includes the action expert's
# vocabulary table (257152 x 1024), which pi0 never uses (the expert reads embeddings, not token ids;
# converted checkpoints hold zeros there). We do not allocate it.
LEROBOT_PI0_PARAMS = 3_501_372_176
EXPERT_VOCAB_TABLE = 257_152 * 1024


def _count(module: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


def test_full_pi0_on_meta_matches_the_reference_count() -> None:
    with torch.device("meta"):
        policy = build_policy("pi0")
        reference = PI0ForConditionalGeneration(PI0Config())  # transformers' own pi0 port, same sizes
    assert all(p.is_meta for p in policy.parameters())
    total = _count(policy)
    assert total == _count(reference) - reference.model.dit.embed_tokens.weight.numel()
    assert total == LEROBOT_PI0_PARAMS - EXPERT_VOCAB_TABLE == 3_238_048_528
    # Frozen: the last VLM layer's q_proj, o_proj, MLP, post-attention norm and the VLM final norm
    # (nothing downstream reads the prefix output of the last layer).
    frozen = 2048 * 2048 * 2 + 3 * 2048 * 16384 + 2048 + 2048
    assert _count(policy, trainable=True) == total - frozen


def test_full_openvla_on_meta_matches_transformers_paligemma() -> None:
    config = PRESETS["openvla"]
    with torch.device("meta"):
        policy = build_policy("openvla")
        text = gemma_config(config.vlm, vocab_size=config.vocab_size, rope_theta=1e4, rms_norm_eps=1e-6)
        reference = PaliGemmaForConditionalGeneration(
            PaliGemmaConfig(
                vision_config=siglip_config(config.vision).to_dict(),
                text_config=text.to_dict(),
                projection_dim=2048,
                hidden_size=2048,
            )
        )
    assert _count(policy) == _count(reference) == 2_923_335_408  # lm_head tied to embed_tokens


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_on_meta_and_round_trips_its_config(name: str) -> None:
    config = PRESETS[name]
    with torch.device("meta"):
        policy = build_policy(name)
    assert isinstance(policy, Pi0Policy if isinstance(config, Pi0Config) else OpenVLAPolicy)
    assert policy.config is config
    assert config_from_dict(config.to_dict()) == config
    # every trainable parameter has a role for optimizer routing; hidden matrices live in decoder layers
    roles = parameters_by_role(policy)
    assert sum(len(v) for v in roles.values()) == sum(1 for p in policy.parameters() if p.requires_grad)
    assert all(".layers." in n or n.startswith("layers.") for n in roles["hidden_matrix"])
    assert len(policy.shard_units()) == config.vlm.depth + config.vision.depth


def test_small_presets_keep_the_reference_aspect_ratios() -> None:
    small, full = PRESETS["pi0_small"], PRESETS["pi0"]
    assert small.vlm.mlp_dim / small.vlm.width == full.vlm.mlp_dim / full.vlm.width == 8
    assert small.expert.mlp_dim / small.expert.width == full.expert.mlp_dim / full.expert.width == 4
    assert small.vlm.width / small.expert.width == full.vlm.width / full.expert.width == 2
    assert small.cameras == PRESETS["pi0_tiny"].cameras == ("top", "wrist")
    assert small.action_horizon == 50 and small.max_action_dim == small.max_state_dim == 32


def test_parameter_roles() -> None:
    policy = build_policy("pi0_tiny")
    named = dict(policy.named_parameters())
    assert (
        parameter_role("layers.0.vlm.mlp.gate_proj.weight", named["layers.0.vlm.mlp.gate_proj.weight"])
        == "hidden_matrix"
    )
    assert parameter_role("state_proj.weight", named["state_proj.weight"]) == "input_output"
    assert parameter_role("action_out_proj.bias", named["action_out_proj.bias"]) == "input_output"
    embed = "prefix_embedder.embed_tokens.weight"
    assert parameter_role(embed, named[embed]) == "input_output"
    ln = "prefix_embedder.vision_tower.encoder.layers.0.layer_norm1.weight"
    assert parameter_role(ln, named[ln]) == "norm"
    fc1 = "prefix_embedder.vision_tower.encoder.layers.0.mlp.fc1"
    assert parameter_role(f"{fc1}.bias", named[f"{fc1}.bias"]) == "bias"
    assert parameter_role(f"{fc1}.weight", named[f"{fc1}.weight"]) == "hidden_matrix"


def test_build_policy_inputs() -> None:
    by_name = build_policy("pi0_tiny", action_horizon=4, vlm={"depth": 3}, expert={"depth": 3})
    assert by_name.config.action_horizon == 4 and len(by_name.layers) == 3
    assert by_name.config.vlm.width == PRESETS["pi0_tiny"].vlm.width  # partial nested override
    from_dict = build_policy({"preset": "openvla_tiny", "action_dim": 2})
    assert isinstance(from_dict, OpenVLAPolicy) and from_dict.config.action_dim == 2
    from_config = build_policy(PRESETS["openvla_tiny"], cameras=["a", "b", "c"])
    assert from_config.config.cameras == ("a", "b", "c")
    with pytest.raises(ValueError, match=r"unknown policy preset 'pi1'; valid presets: \['openvla', "):
        build_policy("pi1")
    with pytest.raises(ValueError, match=r"unknown Pi0Config override\(s\) \['horizon'\]"):
        build_policy("pi0_tiny", horizon=3)
    with pytest.raises(ValueError, match=r"unknown Pi0Config.vlm override\(s\) \['widht'\]"):
        build_policy("pi0_tiny", vlm={"widht": 3})
    with pytest.raises(ValueError, match="needs 'preset'"):
        build_policy({"action_horizon": 3})
    with pytest.raises(TypeError, match="preset name, a PolicyConfig or a dict"):
        build_policy(3)


def test_config_validation_names_the_problem() -> None:
    tiny = PRESETS["pi0_tiny"]
    with pytest.raises(ValueError, match=r"vlm.depth \(2\) != expert.depth \(3\)"):
        tiny.replace(expert={"depth": 3})
    with pytest.raises(ValueError, match=r"vlm.head_dim \(16\) != expert.head_dim \(32\)"):
        tiny.replace(expert={"head_dim": 32})
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        tiny.replace(vlm={"num_kv_heads": 3})
    with pytest.raises(ValueError, match=r"image_size \(30\) must be a multiple of patch_size"):
        tiny.replace(vision={"image_size": 30})
    with pytest.raises(ValueError, match="cameras has duplicates"):
        tiny.replace(cameras=("top", "top"))
    with pytest.raises(ValueError, match=r"vocab_size \(600\) is too small.*>= 640"):
        OpenVLAConfig(vision=tiny.vision, vlm=tiny.vlm, vocab_size=600)
    with pytest.raises(ValueError, match="action_dim must be in"):
        PRESETS["openvla_tiny"].replace(action_dim=40)
