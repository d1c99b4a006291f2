"""BatchProcessor: items -> vla.types.Batch with the shapes, dtypes and value ranges the models expect."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _lerobot_fixtures import ACTION_DIM, FPS, STATE_DIM

from vla.data import (
    BatchProcessor,
    DatasetFormatError,
    LeRobotDataset,
    MissingFeatureError,
    ProcessorConfig,
    make_dataloader,
)
from vla.data.stats import vector_stats
from vla.types import Batch

CAMERA_MAP = {"observation.images.top": "base_0_rgb", "observation.images.wrist": "left_wrist_0_rgb"}
MODEL_CAMERAS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]


def make_config(**overrides) -> ProcessorConfig:
    settings = dict(
        camera_map=CAMERA_MAP, model_cameras=MODEL_CAMERAS, image_size=32, max_state_dim=8, max_action_dim=6,
        action_horizon=4, max_prompt_length=16,
    )  # fmt: skip
    settings.update(overrides)
    return ProcessorConfig(**settings)


def processor_and_dataset(root, **overrides) -> tuple[BatchProcessor, LeRobotDataset]:
    image_dtype = "uint8" if overrides.get("uint8_images") else "float32"
    probe = LeRobotDataset(root)
    processor = BatchProcessor.from_dataset(make_config(**overrides), probe.meta)
    dataset = LeRobotDataset(root, delta_timestamps=processor.delta_timestamps(FPS), image_dtype=image_dtype)
    return processor, dataset


def test_batch_layout_matches_vla_types(image_dataset) -> None:
    processor, dataset = processor_and_dataset(image_dataset.root)
    batch = processor.collate([dataset[i] for i in (0, 4, 11, 20)])
    assert isinstance(batch, Batch) and batch.batch_size == 4
    obs = batch.observation
    assert list(obs.images) == MODEL_CAMERAS and list(obs.image_masks) == MODEL_CAMERAS
    for camera in MODEL_CAMERAS:
        assert obs.images[camera].shape == (4, 3, 32, 32) and obs.images[camera].dtype == torch.float32
        assert obs.image_masks[camera].shape == (4,) and obs.image_masks[camera].dtype == torch.bool
    assert obs.image_masks["base_0_rgb"].all() and not obs.image_masks["right_wrist_0_rgb"].any()
    assert torch.all(obs.images["right_wrist_0_rgb"] == -1.0)
    top = obs.images["base_0_rgb"]
    assert top.min() >= -1.0 and top.max() <= 1.0
    assert torch.all(top[:, :, :5] == -1.0)  # 16x24 resized to 21x32: padded rows are black -> -1
    assert obs.state.shape == (4, 8) and obs.state.dtype == torch.float32
    assert torch.all(obs.state[:, STATE_DIM:] == 0)
    assert obs.tokenized_prompt.shape == obs.tokenized_prompt_mask.shape == (4, 16)
    assert obs.tokenized_prompt.dtype == torch.int64 and obs.tokenized_prompt_mask.dtype == torch.bool
    assert batch.actions.shape == (4, 4, 6) and batch.actions.dtype == torch.float32
    assert torch.all(batch.actions[:, :, ACTION_DIM:] == 0)
    assert batch.action_is_pad.shape == (4, 4) and batch.action_is_pad.dtype == torch.bool
    assert batch.action_is_pad[1].tolist() == [False, True, True, True]  # frame 4 ends episode 0
    assert batch.action_dim_mask.tolist() == [[True] * ACTION_DIM + [False] * 4] * 4
    assert batch.meta["index"].tolist() == [0, 4, 11, 20]
    assert batch.meta["task"] == [image_dataset.tasks[i] for i in (0, 4, 11, 20)]


def test_state_and_actions_are_normalised_with_dataset_stats(image_dataset) -> None:
    processor, dataset = processor_and_dataset(
        image_dataset.root, norm_modes={"observation.state": "MEAN_STD", "action": "QUANTILES"}
    )
    batch = processor.collate([dataset[i] for i in range(len(dataset))])
    state_stats = vector_stats(image_dataset.state)
    expected_state = (image_dataset.state - state_stats["mean"]) / (state_stats["std"] + 1e-6)
    np.testing.assert_allclose(batch.observation.state[:, :STATE_DIM].numpy(), expected_state, atol=1e-5)
    action_stats = vector_stats(image_dataset.action)
    low, high = action_stats["q01"], action_stats["q99"]
    expected_first_action = 2 * (image_dataset.action - low) / (high - low + 1e-6) - 1
    np.testing.assert_allclose(batch.actions[:, 0, :ACTION_DIM].numpy(), expected_first_action, atol=1e-5)
    restored = processor.unnormalize_actions(batch.actions)
    assert restored.shape == (len(dataset), 4, ACTION_DIM)
    np.testing.assert_allclose(restored[:, 0].numpy(), image_dataset.action, atol=1e-4)


def test_prompts_are_bos_task_newline(image_dataset) -> None:
    processor, dataset = processor_and_dataset(image_dataset.root)
    batch = processor.collate([dataset[0]])
    ids = batch.observation.tokenized_prompt[0][batch.observation.tokenized_prompt_mask[0]].tolist()
    tokenizer = processor.prompts.tokenizer
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == "pick the red cube\n"


def test_uint8_transport_matches_float_after_finalize(video_dataset) -> None:
    float_processor, float_dataset = processor_and_dataset(video_dataset.root)
    uint8_processor, uint8_dataset = processor_and_dataset(video_dataset.root, uint8_images=True)
    indices = [1, 6, 13]
    float_batch = float_processor.collate([float_dataset[i] for i in indices])
    uint8_batch = uint8_processor.collate([uint8_dataset[i] for i in indices])
    assert uint8_batch.observation.images["base_0_rgb"].dtype == torch.uint8
    assert uint8_batch.observation.images["right_wrist_0_rgb"].dtype == torch.uint8
    finalized = uint8_processor.finalize(uint8_batch)
    for camera in MODEL_CAMERAS:
        image = finalized.observation.images[camera]
        assert image.dtype == torch.float32
        torch.testing.assert_close(image, float_batch.observation.images[camera], atol=2.5 / 255, rtol=0)
    torch.testing.assert_close(finalized.actions, float_batch.actions)
    assert float_processor.finalize(float_batch) is float_batch  # final batches pass through


@pytest.mark.parametrize("uint8", [True, False])
def test_resize_on_finalize_ships_native_images(video_dataset, uint8) -> None:
    reference_processor, dataset = processor_and_dataset(video_dataset.root, uint8_images=uint8)
    deferred_processor = BatchProcessor.from_dataset(
        make_config(uint8_images=uint8, resize_on_finalize=True), dataset.meta
    )
    items = [dataset[i] for i in (0, 8, 17)]
    shipped = deferred_processor.collate(items)
    assert shipped.observation.images["base_0_rgb"].shape == (3, 3, 16, 24)  # stored resolution
    final = deferred_processor.finalize(shipped)
    reference = reference_processor.finalize(reference_processor.collate(items))
    for camera in MODEL_CAMERAS:
        assert final.observation.images[camera].shape == (3, 3, 32, 32)
        torch.testing.assert_close(
            final.observation.images[camera], reference.observation.images[camera], atol=2.5 / 255, rtol=0
        )


def test_state_dict_rebuilds_the_same_processor(image_dataset) -> None:
    processor, dataset = processor_and_dataset(
        image_dataset.root, norm_modes={"observation.state": "MIN_MAX", "action": "MEAN_STD"}
    )
    rebuilt = BatchProcessor.from_state_dict(processor.state_dict())
    items = [dataset[i] for i in (2, 9)]
    original, again = processor.collate(items), rebuilt.collate(items)
    torch.testing.assert_close(again.actions, original.actions)
    torch.testing.assert_close(again.observation.state, original.observation.state)
    assert torch.equal(again.observation.tokenized_prompt, original.observation.tokenized_prompt)
    observation = rebuilt.observation([{k: v for k, v in items[0].items() if k != "action"}])  # inference
    torch.testing.assert_close(observation.state, original.observation.state[:1])


def test_config_errors_name_the_missing_feature(image_dataset) -> None:
    meta = LeRobotDataset(image_dataset.root).meta
    with pytest.raises(MissingFeatureError, match=r"observation\.images\.front.*observation\.images\.top"):
        BatchProcessor.from_dataset(make_config(camera_map={"observation.images.front": "base_0_rgb"}), meta)
    with pytest.raises(MissingFeatureError, match=r"\['observation\.joints'\].*Available features"):
        BatchProcessor.from_dataset(make_config(state_key="observation.joints"), meta)
    with pytest.raises(ValueError, match="max_action_dim"):
        BatchProcessor.from_dataset(make_config(max_action_dim=1), meta)
    with pytest.raises(ValueError, match="which are not cameras of the model"):
        BatchProcessor.from_dataset(make_config(model_cameras=["base_0_rgb"]), meta)
    processor = BatchProcessor.from_dataset(make_config(), meta)
    no_window = LeRobotDataset(image_dataset.root)
    with pytest.raises(DatasetFormatError, match=r"delta_timestamps=processor\.delta_timestamps"):
        processor.collate([no_window[0]])


def test_dataloader_with_two_workers_matches_in_process_loading(video_dataset) -> None:
    processor, dataset = processor_and_dataset(video_dataset.root, uint8_images=True)
    in_process = list(
        make_dataloader(dataset, processor, batch_size=4, num_workers=0, seed=3, rank=0, world_size=1)
    )
    workers = list(
        make_dataloader(dataset, processor, batch_size=4, num_workers=2, seed=3, rank=0, world_size=1)
    )
    assert len(in_process) == len(workers) == 21 // 4
    for a, b in zip(in_process, workers):
        assert a.meta["index"].tolist() == b.meta["index"].tolist()
        assert a.observation.images["base_0_rgb"].dtype == torch.float32  # finalized by the loader
        torch.testing.assert_close(a.observation.images["base_0_rgb"], b.observation.images["base_0_rgb"])
        torch.testing.assert_close(a.actions, b.actions)


def _children() -> dict[int, str]:
    """This process's child processes: pid -> command line (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == os.getpid():
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def test_loader_workers_start_from_a_forkserver_not_a_fork_of_this_threaded_process(video_dataset) -> None:
    # A fork copies a lock another thread holds; on CPython 3.11.7 a forked worker was seen to stop for
    # good inside the fork (gh-112275). Workers from the forkserver are its children, not ours.
    processor, dataset = processor_and_dataset(video_dataset.root, uint8_images=True)
    before = _children()
    loader = make_dataloader(dataset, processor, batch_size=4, num_workers=2, seed=3, rank=0, world_size=1)
    batches = iter(loader)
    next(batches)  # the two persistent workers are running now
    started = [cmd for pid, cmd in _children().items() if pid not in before]
    # Forked workers would be two new children with this process's command line; the only child a
    # loader may add is the forkserver itself (started by the first loader of this process).
    assert all("from multiprocessing.forkserver import main" in cmd for cmd in started), started
    assert len(list(batches)) == 21 // 4 - 1  # and the workers deliver the rest of the epoch


def test_raw_uint8_frames_are_resized_in_float_as_lerobot_does(image_dataset) -> None:
    """Inference (float output): raw uint8 environment frames (H, W, 3) are scaled to [0, 1] and resized in
    float, as LeRobot's pi0 preprocessing does (bilinear, align_corners=False, no antialias when enlarging),
    so the two give the same pixels; uint8 transport still resizes uint8 (within one intensity level)."""
    import torch.nn.functional as F

    processor, _ = processor_and_dataset(image_dataset.root, image_size=56)
    frames = np.random.default_rng(0).integers(0, 256, size=(2, 28, 28, 3), dtype=np.uint8)
    items = [
        {"observation.images.top": f, "observation.images.wrist": f, "observation.state": torch.zeros(STATE_DIM),
         "task": "t"} for f in frames
    ]  # fmt: skip
    ours = processor.observation(items).images["base_0_rgb"]
    reference = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
    reference = F.interpolate(reference, size=(56, 56), mode="bilinear", align_corners=False) * 2.0 - 1.0
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    transported, _ = processor_and_dataset(image_dataset.root, image_size=56, uint8_images=True)
    shipped = transported.finalize(Batch(observation=transported.observation(items), actions=None,
                                         action_is_pad=None, action_dim_mask=None, meta={}))  # fmt: skip
    assert (shipped.observation.images["base_0_rgb"] - reference).abs().max() <= 2.0 / 255.0 + 1e-6
