"""Training-time image augmentation: each transform's maths, determinism, and where it is (never) applied."""

from __future__ import annotations

import colorsys

import numpy as np
import pytest
import torch

from vla.data import ProcessorConfig, build_pipeline
from vla.data.augment import (
    ImageAugmenter,
    ImageTransformConfig,
    ImageTransformsConfig,
    _shift_hue,
    lerobot_default_tfs,
)


def _augmenter(tfs: dict[str, ImageTransformConfig], cameras=("top",), seed: int = 0, **kw) -> ImageAugmenter:
    config = ImageTransformsConfig(enable=True, max_num_transforms=kw.pop("k", len(tfs)), tfs=tfs, **kw)
    return ImageAugmenter(config, list(cameras), seed)


def _images(batch: int = 6, size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 3, size, size), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint8
    )


EVERYTHING = lerobot_default_tfs() | {
    "shift": ImageTransformConfig(1.0, "RandomShift", {"pad": 3}),
    "crop": ImageTransformConfig(1.0, "RandomResizedCrop", {"scale": [0.8, 0.9], "ratio": [0.9, 1.1]}),
}


def test_shape_and_dtype_are_kept_for_uint8_and_float() -> None:
    augmenter = _augmenter(EVERYTHING)
    images = _images()
    keys = [(0, i) for i in range(6)]
    out = augmenter.augment(images, "top", keys)
    assert out.shape == images.shape and out.dtype == torch.uint8 and not torch.equal(out, images)
    as_float = images.float() / 255
    out_float = augmenter.augment(as_float, "top", keys)
    assert out_float.dtype == torch.float32 and out_float.shape == images.shape
    assert 0.0 <= out_float.min() and out_float.max() <= 1.0
    # the uint8 path is the float path, rounded
    assert (out_float.mul(255).round() - out.float()).abs().max() <= 1


def test_deterministic_for_a_seed_and_different_across_frames_epochs_and_seeds() -> None:
    same = _images(1).expand(4, -1, -1, -1).contiguous()  # four copies of one frame
    keys = [(0, 0), (0, 1), (1, 0), (0, 0)]
    a = _augmenter(EVERYTHING, k=3).augment(same, "top", keys)
    b = _augmenter(EVERYTHING, k=3).augment(same, "top", keys)
    assert torch.equal(a, b)  # same seed, same keys: bit-identical
    assert torch.equal(a[0], a[3])  # the same (epoch, index) always draws the same
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])  # another frame, another epoch
    other_seed = _augmenter(EVERYTHING, k=3, seed=1).augment(same, "top", keys)
    assert not torch.equal(other_seed[0], a[0])
    # a frame's draw does not depend on the batch it is in (ranks, workers and resumes batch differently)
    alone = _augmenter(EVERYTHING, k=3).augment(same[1:2], "top", keys[1:2])
    assert torch.equal(alone[0], a[1])


def test_subset_draws_follow_max_num_transforms_and_weights() -> None:
    tfs = lerobot_default_tfs()
    tfs["hue"].weight = 0.0  # never drawn
    augmenter = _augmenter(tfs, k=2)
    counts = {name: 0 for name in tfs}
    for index in range(300):
        plan = augmenter.draws("top", (0, index), 16, 16)
        assert len(plan) == 2 and plan[0][0] < plan[1][0]  # listed order
        for i, _ in plan:
            counts[augmenter.names[i]] += 1
    assert "hue" not in augmenter.names and counts["hue"] == 0
    assert all(100 < counts[n] < 140 for n in augmenter.names), counts  # 2 of 5 equally weighted: ~120 each


def test_shift_moves_the_image_by_whole_pixels_with_replicated_edges() -> None:
    augmenter = _augmenter({"shift": ImageTransformConfig(1.0, "RandomShift", {"pad": 2})})
    images = _images(8)
    keys = [(0, i) for i in range(8)]
    out = augmenter.augment(images, "top", keys)
    for n, key in enumerate(keys):
        (_, p), = augmenter.draws("top", key, 16, 16)  # fmt: skip
        rows = (torch.arange(16) - p["dy"]).clamp(0, 15)
        cols = (torch.arange(16) - p["dx"]).clamp(0, 15)
        assert torch.equal(out[n], images[n][:, rows][:, :, cols])


def test_colour_maths_match_the_definitions() -> None:
    x = torch.rand(2, 3, 5, 5)
    shifted = _shift_hue(x, torch.tensor([0.1, -0.3]))
    for n, shift in enumerate([0.1, -0.3]):
        for i in range(5):
            h, s, v = colorsys.rgb_to_hsv(*x[n, :, i, 0].tolist())
            np.testing.assert_allclose(shifted[n, :, i, 0], colorsys.hsv_to_rgb((h + shift) % 1, s, v), atol=1e-5)
    augmenter = _augmenter({"b": ImageTransformConfig(1.0, "ColorJitter", {"brightness": [1.5, 1.5]})})
    images = torch.full((1, 3, 4, 4), 100, dtype=torch.uint8)
    assert (augmenter.augment(images, "top", [(0, 0)]) == 150).all()
    flat = _augmenter({"c": ImageTransformConfig(1.0, "ColorJitter", {"contrast": [0.0, 0.0]})})
    out = flat.augment(_images(1), "top", [(0, 0)])
    assert out.float().std() < 1  # contrast 0: one grey level


def test_identity_parameters_change_nothing() -> None:
    tfs = {
        "crop": ImageTransformConfig(1.0, "RandomResizedCrop", {"scale": [1.0, 1.0], "ratio": [1.0, 1.0]}),
        "affine": ImageTransformConfig(1.0, "RandomAffine", {"degrees": 0}),
        "shift": ImageTransformConfig(1.0, "RandomShift", {"pad": 0}),
        "colour": ImageTransformConfig(1.0, "ColorJitter", {"brightness": 0, "saturation": 0, "hue": 0}),
        "sharpness": ImageTransformConfig(1.0, "SharpnessJitter", {"sharpness": [1.0, 1.0]}),
    }
    images = _images(4)
    assert torch.equal(_augmenter(tfs).augment(images, "top", [(0, i) for i in range(4)]), images)


def test_wrist_cameras_get_colour_only_or_nothing() -> None:
    tfs = {
        "shift": ImageTransformConfig(1.0, "RandomShift", {"pad": 3}),
        "colour": ImageTransformConfig(1.0, "ColorJitter", {"brightness": 0.3}),
    }
    cameras = ("top", "left_wrist")
    augmenter = _augmenter(tfs, cameras)
    kinds = {augmenter.specs[i].type for k in range(20) for i, _ in augmenter.draws("left_wrist", (0, k), 16, 16)}
    assert kinds == {"ColorJitter"}
    assert len(augmenter.draws("top", (0, 0), 16, 16)) == 2
    untouched = _augmenter(tfs, cameras, wrist="none")
    images = _images(3)
    assert torch.equal(untouched.augment(images, "left_wrist", [(0, i) for i in range(3)]), images)
    named = _augmenter(tfs, cameras, wrist_cameras=["top"])  # an explicit list replaces the name rule
    assert {named.specs[i].type for i, _ in named.draws("top", (0, 1), 16, 16)} == {"ColorJitter"}
    assert len(named.draws("left_wrist", (0, 1), 16, 16)) == 2


@pytest.mark.parametrize(
    ("tfs", "message"),
    [
        ({"x": {"type": "Blur", "kwargs": {"k": 1}}}, "type='Blur'"),
        ({"x": {"type": "ColorJitter", "kwargs": {"gamma": 1}}}, "unknown: \\['gamma'\\]"),
        ({"x": {"type": "ColorJitter", "kwargs": {"brightness": [1.2, 0.8]}}}, "low <= high"),
        ({"x": {"type": "RandomShift", "kwargs": {"pad": -1}}}, "pad must be an int >= 0"),
        ({"x": {"type": "ColorJitter", "kwargs": {"hue": 0.7}}}, "hue must lie in"),
        ({"x": {"type": "RandomShift", "kwargs": {"pad": 1}, "p": 0.5}}, "must be a dict with keys"),
        ({"x": {"weight": 0.0, "type": "RandomShift", "kwargs": {"pad": 1}}}, "no transform .* has a weight"),
    ],
)
def test_bad_settings_name_the_key(tfs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ImageTransformsConfig(enable=True, tfs=tfs)


def _pipeline(dataset, transforms: ImageTransformsConfig | None):
    config = ProcessorConfig(
        camera_map={"observation.images.top": "top", "observation.images.wrist": "wrist"}, image_size=16,
        max_state_dim=8, max_action_dim=8, action_horizon=3, uint8_images=True,
    )  # fmt: skip
    return build_pipeline(
        dataset.root, config, batch_size=4, val_fraction=0.34, rank=0, world_size=1, image_transforms=transforms
    )


def test_pipeline_augments_training_batches_only(image_dataset) -> None:
    on = ImageTransformsConfig(enable=True, tfs=EVERYTHING)
    plain, augmented = _pipeline(image_dataset, None), _pipeline(image_dataset, on)
    off = _pipeline(image_dataset, ImageTransformsConfig(enable=False, tfs=EVERYTHING))
    assert augmented.train.augment is not None and off.train.augment is None and augmented.val.augment is None
    first = [next(iter(p.train)) for p in (plain, off, augmented)]
    assert torch.equal(first[0].meta["index"], first[2].meta["index"])  # same samples, same order
    assert torch.equal(first[0].observation.images["top"], first[1].observation.images["top"])  # off: identity
    assert not torch.equal(first[0].observation.images["top"], first[2].observation.images["top"])
    assert torch.equal(first[0].actions, first[2].actions) and torch.equal(first[0].observation.state, first[2].observation.state)
    # validation batches and the processor that inference and the closed loop use are never augmented
    for a, b in zip(plain.val, augmented.val):
        assert torch.equal(a.observation.images["top"], b.observation.images["top"])
    items = [augmented.train_dataset[i] for i in range(3)]
    assert torch.equal(augmented.processor.observation(items).images["top"], plain.processor.observation(items).images["top"])
    assert "augment" not in str(augmented.processor.state_dict())


def test_a_resumed_loader_augments_as_the_uninterrupted_one(image_dataset) -> None:
    on = ImageTransformsConfig(enable=True, tfs=EVERYTHING)
    straight = _pipeline(image_dataset, on).train
    stream = straight.forever()
    batches = [next(stream) for _ in range(len(straight) + 2)]  # into the second epoch
    resumed = _pipeline(image_dataset, on).train
    head = resumed.forever()
    next(head)
    state = resumed.state_dict()
    fresh = _pipeline(image_dataset, on).train
    fresh.load_state_dict(state)
    rest = fresh.forever()
    for expected in batches[1:]:
        got = next(rest)
        assert torch.equal(got.observation.images["top"], expected.observation.images["top"])
