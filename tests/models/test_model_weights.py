"""Checkpoint loading/saving in the LeRobot pi0 and transformers PaliGemma layouts, on tiny checkpoints."""

from __future__ import annotations

import json
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


def test_saved_weights_are_the_same_bytes_however_often_they_are_written(tmp_path) -> None:
    """safetensors writes its metadata map in a random order per write (safetensors#584): a user's
    metadata of several entries gave a different file, and sha256, on every save of the same weights."""
    from safetensors import safe_open

    policy = build_policy("pi0_tiny")
    metadata = {f"entry_{i}": "x" * i for i in range(1, 9)} | {"note": 'a "quoted" café ✓'}
    files = [save_pi0_weights(policy, tmp_path / f"w{i}.safetensors", metadata=metadata) for i in range(6)]
    assert len({f.read_bytes() for f in files}) == 1
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt", **metadata}
    raw = files[0].read_bytes()
    assert list(json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]) == sorted(
        ["format", *metadata]
    )
    assert not list(tmp_path.glob(".*tmp*")), "the atomic write left a temporary file"


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


# ------------------------------------------------------------------------------------------------------
# The trainer's export (vla.training.export) and the layout detection of model.weights= (issue 11)

# LeRobot 0.4.4's PI0Config / PreTrainedConfig fields (src/lerobot/policies/pi0/configuration_pi0.py,
# src/lerobot/configs/policies.py); draccus refuses any other key in config.json.
LEROBOT_PI0_CONFIG_FIELDS = {
    "type", "n_obs_steps", "input_features", "output_features", "device", "use_amp", "push_to_hub",
    "repo_id", "private", "tags", "license", "pretrained_path", "paligemma_variant", "action_expert_variant",
    "dtype", "chunk_size", "n_action_steps", "max_state_dim", "max_action_dim", "num_inference_steps",
    "time_sampling_beta_alpha", "time_sampling_beta_beta", "time_sampling_scale", "time_sampling_offset",
    "min_period", "max_period", "rtc_config", "image_resolution", "empty_cameras", "normalization_mapping",
    "gradient_checkpointing", "compile_model", "compile_mode", "freeze_vision_encoder", "train_expert_only",
    "optimizer_lr", "optimizer_betas", "optimizer_eps", "optimizer_weight_decay", "optimizer_grad_clip_norm",
    "scheduler_warmup_steps", "scheduler_decay_steps", "scheduler_decay_lr", "tokenizer_max_length",
}  # fmt: skip


def _trained_like(name: str) -> nn.Module:
    """A policy whose weights differ from a fresh build (so a load that does nothing cannot pass)."""
    torch.manual_seed(123)
    policy = build_policy(name)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    return policy.eval()


def _same_outputs(a: nn.Module, b: nn.Module) -> None:
    batch = make_batch(a.config)
    torch.manual_seed(0)
    if a.config.kind == "pi0":
        noise = torch.randn(2, a.config.action_horizon, a.config.max_action_dim)
        assert torch.equal(a.sample_actions(batch, noise=noise), b.sample_actions(batch, noise=noise))
    else:
        assert torch.equal(a.sample_actions(batch), b.sample_actions(batch))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_pi0_export_is_lerobot_named_and_round_trips_bitwise(tmp_path) -> None:
    from vla.eval.policy_runner import load_exported_policy
    from vla.models.weights import lerobot_pi0_key_set, load_weights
    from vla.training.checkpoint import read_safetensors_metadata
    from vla.training.export import LEROBOT_DIR, write_export

    source = _trained_like("pi0_tiny")
    path = write_export(source.state_dict(), source.config, tmp_path)
    tensors = load_file(str(path))
    # Exactly the key set LeRobot's PI0Policy holds (its strict load needs all and only these) ...
    reference = _lerobot_state_dict(_lerobot_like_pi0(source.config))
    assert set(tensors) == set(reference) == lerobot_pi0_key_set(source.config)
    assert len(tensors) == 90 and all(k.startswith("model.paligemma_with_expert.") or k.startswith(
        ("model.state_proj.", "model.action_")) for k in tensors)  # fmt: skip
    # ... with LeRobot's shapes, and strict-loadable into the LeRobot-shaped module tree.
    for key, value in reference.items():
        assert tensors[key].shape == value.shape, key
    lerobot_like = _lerobot_like_pi0(source.config)
    lerobot_like.load_state_dict(
        {k.replace(".vision_model.", "."): v for k, v in tensors.items()}, strict=True
    )
    assert torch.equal(
        lerobot_like.model.paligemma_with_expert.gemma_expert.model.layers[1].mlp.down_proj.weight,
        source.layers[1].expert.mlp.down_proj.weight,
    )
    metadata = read_safetensors_metadata(path)
    assert metadata["format"] == "pt" and metadata["vla.layout"] == "lerobot_pi0"
    assert not (tmp_path / LEROBOT_DIR).exists()  # pi0_tiny: LeRobot's PI0Config cannot describe it
    # With a LeRobot config (the full-size presets): LeRobot's from_pretrained directory, same weights.
    with_config = write_export(source.state_dict(), source.config, tmp_path / "full", {"type": "pi0"})
    directory = tmp_path / "full" / LEROBOT_DIR
    assert (directory / "model.safetensors").read_bytes() == with_config.read_bytes()
    assert load_file(str(directory / "model.safetensors")).keys() == tensors.keys()
    assert json.loads((directory / "config.json").read_text()) == {"type": "pi0"}

    # Round trip: the exported policy (config from the metadata) and model.weights= give the same outputs.
    _same_outputs(source, load_exported_policy(path))
    fresh = build_policy("pi0_tiny")
    report = load_weights(fresh, path)
    assert report.left_initialised == []
    _same_outputs(source, fresh.eval())


def test_old_exports_and_openvla_exports_load(tmp_path) -> None:
    from vla.eval.policy_runner import load_exported_policy
    from vla.models.weights import detect_layout, load_weights
    from vla.training.checkpoint import read_safetensors_metadata
    from vla.training.export import write_export, write_safetensors

    def old_export(policy, path):  # the header exports had before the LeRobot-named layout
        header = {
            "format": "vla.policy",
            "policy_config": json.dumps(policy.config.to_dict(), sort_keys=True),
        }
        write_safetensors(policy.state_dict(), path, header)
        return path

    # An export written before the LeRobot-named export: our names + "policy_config" in the metadata.
    old_pi0 = _trained_like("pi0_tiny")
    old_file = old_export(old_pi0, tmp_path / "old" / "policy.safetensors")
    assert detect_layout(set(load_file(str(old_file)))) == "vla"
    _same_outputs(old_pi0, load_exported_policy(old_file))
    fresh = build_policy("pi0_tiny")
    load_weights(fresh, old_file)  # model.weights= takes it too
    _same_outputs(old_pi0, fresh.eval())

    # OpenVLA-style: our names (LeRobot has no OpenVLA policy), the tied LM head stored once.
    openvla = _trained_like("openvla_tiny")
    path = write_export(openvla.state_dict(), openvla.config, tmp_path / "openvla")
    assert read_safetensors_metadata(path)["vla.layout"] == "vla"
    _same_outputs(openvla, load_exported_policy(path))
    old_openvla = old_export(openvla, tmp_path / "old_openvla" / "policy.safetensors")
    _same_outputs(openvla, load_exported_policy(old_openvla))


def test_model_weights_detects_the_layout_and_names_what_does_not_fit(tmp_path) -> None:
    from vla.models.weights import detect_layout, load_weights

    config = build_policy("pi0_tiny").config
    _paligemma(config).save_pretrained(tmp_path / "paligemma")
    assert detect_layout(set(load_file(str(tmp_path / "paligemma" / "model.safetensors")))) == "paligemma"
    pi0 = build_policy("pi0_tiny")
    report = load_weights(pi0, tmp_path / "paligemma")
    assert "state_proj.weight" in report.left_initialised  # the expert stays as initialised

    lerobot_file = save_pi0_weights(_trained_like("pi0_tiny"), tmp_path / "lerobot.safetensors")
    assert detect_layout(set(load_file(str(lerobot_file)))) == "lerobot_pi0"
    with pytest.raises(ValueError, match="LeRobot/openpi pi0 checkpoint; it cannot initialise the OpenVLA"):
        load_weights(build_policy("openvla_tiny"), lerobot_file)
    save_file({"encoder.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"cannot tell the layout.*encoder\.weight.*model\.weights_format"):
        load_weights(pi0, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointMismatchError, match="missing keys"):  # forcing the wrong layout
        load_weights(pi0, lerobot_file, "vla")


def test_lerobot_config_json_for_the_full_size_pi0() -> None:
    from vla.models import PRESETS
    from vla.training.export import lerobot_pi0_config, lerobot_unsupported

    features = {
        "observation.images.cam_high": {"shape": [480, 640, 3], "names": ["height", "width", "channels"]},
        "observation.state": {"shape": [14]},
        "action": {"shape": [14]},
    }
    config = lerobot_pi0_config(
        PRESETS["pi0"],
        features=features,
        camera_map={"observation.images.cam_high": "base_0_rgb"},
        state_key="observation.state",
        action_key="action",
        norm_modes={"action": "MIN_MAX"},
        tokenizer_max_length=48,
    )
    assert set(config) <= LEROBOT_PI0_CONFIG_FIELDS
    assert config["type"] == "pi0"
    assert (config["paligemma_variant"], config["action_expert_variant"]) == ("gemma_2b", "gemma_300m")
    assert config["input_features"] == {
        "observation.images.cam_high": {"type": "VISUAL", "shape": [3, 480, 640]},
        "observation.state": {"type": "STATE", "shape": [14]},
    }
    assert config["output_features"] == {"action": {"type": "ACTION", "shape": [14]}}
    assert config["empty_cameras"] == 2  # the two wrist cameras no dataset key maps to
    assert config["normalization_mapping"] == {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MIN_MAX"}
    assert (config["chunk_size"], config["image_resolution"]) == (50, [224, 224])
    assert config["n_action_steps"] == 50  # no replan interval given: the whole chunk is played
    common = dict(
        features=features, camera_map={"observation.images.cam_high": "base_0_rgb"}, state_key="observation.state",
        action_key="action", norm_modes={"action": "MIN_MAX"}, tokenizer_max_length=48)  # fmt: skip
    assert lerobot_pi0_config(PRESETS["pi0"], **common, n_action_steps=5)["n_action_steps"] == 5
    assert lerobot_pi0_config(PRESETS["pi0"], **common, n_action_steps=80)["n_action_steps"] == 50  # capped
    with pytest.raises(ValueError, match="n_action_steps must be an int >= 1"):
        lerobot_pi0_config(PRESETS["pi0"], **common, n_action_steps=0)
    assert config["time_sampling_scale"] == pytest.approx(0.999) and config["time_sampling_offset"] == 0.001
    assert lerobot_unsupported(PRESETS["pi0"]) is None
    assert "vlm is not gemma_2b" in lerobot_unsupported(PRESETS["pi0_small"])


def test_loading_weights_into_a_state_blind_pi0_keeps_its_state_weight_at_zero(tmp_path) -> None:
    source = build_policy("pi0_tiny")
    assert source.state_proj.weight.abs().max() > 0
    path = save_pi0_weights(source, tmp_path / "source.safetensors")
    blind = build_policy("pi0_tiny", use_state=False)
    load_pi0_weights(blind, path)
    assert blind.state_proj.weight.abs().max() == 0 and not blind.state_proj.weight.requires_grad
    torch.testing.assert_close(blind.state_proj.bias, source.state_proj.bias)
    torch.testing.assert_close(blind.action_out_proj.weight, source.action_out_proj.weight)
