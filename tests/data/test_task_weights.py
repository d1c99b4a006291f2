"""data.task_weights: per-task draw shares, stratified epochs, determinism, resume, and bad weights."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from vla.data import ProcessorConfig, ShardedResumableSampler, build_pipeline
from vla.data.mixture import task_mixture
from vla.data.errors import TaskWeightsError

TASKS = ["reach", "push", "drawer"]
# 10 frames of reach, 30 of push, 60 of drawer, interleaved as episodes would not be (the order must not matter)
TASK_INDEX = np.array([0] * 10 + [1] * 30 + [2] * 60)[np.random.default_rng(0).permutation(100)]


def test_a_weight_scales_a_tasks_frames_and_every_epoch_draws_exactly_its_share() -> None:
    mixture = task_mixture(TASK_INDEX, TASKS, {"reach": 3.0, "drawer": 0.5}, "ds")
    assert mixture is not None
    # mass reach 3 x 10 = 30, push 30, drawer 30: a third each of the 100 draws (largest remainder: 34/33/33)
    assert mixture.counts == (34, 33, 33) and mixture.num_samples == 100
    order = mixture.order(torch.Generator().manual_seed(0))
    per_task = Counter(TASKS[TASK_INDEX[i]] for i in order)
    assert per_task == {"reach": 34, "push": 33, "drawer": 33}
    # stratified: within a task no frame comes twice before every frame came once
    reach_frames = Counter(i for i in order if TASK_INDEX[i] == 0)
    assert set(reach_frames) == set(np.flatnonzero(TASK_INDEX == 0).tolist())
    assert sorted(reach_frames.values()) == [3] * 6 + [4] * 4
    assert len(set(i for i in order if TASK_INDEX[i] == 2)) == 33  # 33 of drawer's 60 frames, none twice
    assert "'reach' 10.0% -> 34.0%" in mixture.describe()


def test_weight_zero_leaves_a_task_out_and_ones_change_nothing() -> None:
    mixture = task_mixture(TASK_INDEX, TASKS, {"push": 0}, "ds")
    assert mixture is not None and mixture.counts == (14, 0, 86)
    assert all(TASK_INDEX[i] != 1 for i in mixture.order(torch.Generator().manual_seed(1)))
    assert task_mixture(TASK_INDEX, TASKS, {}, "ds") is None
    assert task_mixture(TASK_INDEX, TASKS, {"reach": 1, "push": 1.0}, "ds") is None
    # a task absent from the training split does not count, whatever its weight
    assert task_mixture(TASK_INDEX[TASK_INDEX != 0], TASKS, {"reach": 5}, "ds") is None


def test_the_order_depends_on_seed_and_epoch_and_ranks_split_it() -> None:
    mixture = task_mixture(TASK_INDEX, TASKS, {"reach": 3.0}, "ds")
    first = ShardedResumableSampler(100, seed=3, mixture=mixture).indices()
    assert ShardedResumableSampler(100, seed=3, mixture=mixture).indices() == first
    assert ShardedResumableSampler(100, seed=4, mixture=mixture).indices() != first
    later = ShardedResumableSampler(100, seed=3, mixture=mixture)
    later.set_epoch(1)
    assert later.indices() != first
    shards = [ShardedResumableSampler(100, seed=3, rank=r, world_size=4, mixture=mixture).indices() for r in range(4)]
    assert sorted(i for shard in shards for i in shard) == sorted(first)
    resumed = ShardedResumableSampler(100, seed=3, rank=1, world_size=4, mixture=mixture)
    resumed.set_start(10)
    assert list(resumed) == shards[1][10:]
    with pytest.raises(ValueError, match="draws 100 samples"):
        ShardedResumableSampler(99, mixture=mixture)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"grasp": 2}, r"names \['grasp'\], not a task of ds; its tasks are \['reach', 'push', 'drawer'\]"),
        ({"push": -1}, r"data.task_weights\['push'\] is -1: a weight is a finite number >= 0"),
        ({"push": float("nan")}, "a weight is a finite number"),
        ({"reach": 0, "push": 0, "drawer": 0}, "weight 0 to every task"),
    ],
)
def test_bad_weights_are_refused_naming_the_task_and_the_fix(weights, match) -> None:
    with pytest.raises(TaskWeightsError, match=match):
        task_mixture(TASK_INDEX, TASKS, weights, "ds")


def test_the_training_loader_draws_by_the_weights_and_validation_keeps_every_frame(make_dataset) -> None:
    written = make_dataset([20, 20, 20, 20, 10])  # tasks alternate: pick 50 frames, drawer 40
    config = ProcessorConfig(
        camera_map={"observation.images.top": "cam"}, image_size=8, max_state_dim=4, max_action_dim=4,
        action_horizon=1,
    )  # fmt: skip

    def pipeline(task_weights):
        return build_pipeline(
            written.root, config, batch_size=10, val_fraction=0.2, rank=0, world_size=1, task_weights=task_weights
        )

    weighted, plain = pipeline({"open the drawer": 3}), pipeline(None)
    train_frames = len(weighted.train_dataset)
    task_of = dict(
        zip(
            weighted.train_dataset.column("index").tolist(),
            weighted.train_dataset.column("task_index").tolist(),
            strict=True,
        )
    )
    drawer = weighted.train_dataset.meta.tasks.index("open the drawer")
    frames_drawer = sum(t == drawer for t in task_of.values())
    expected = round(train_frames * 3 * frames_drawer / (3 * frames_drawer + train_frames - frames_drawer))
    drawn = [i for batch in weighted.train for i in batch.meta["index"].tolist()]
    assert len(drawn) == train_frames // 10 * 10
    # the epoch holds `expected` drawer draws; the dropped last partial batch can take at most 9 of them
    assert expected - 9 <= sum(task_of[i] == drawer for i in drawn) <= expected
    assert any("'open the drawer'" in note and "->" in note for note in weighted.notes)
    assert not any("task_weights" in note for note in plain.notes)
    val_weighted = [i for b in weighted.val for i in b.meta["index"].tolist()]
    val_plain = [i for b in plain.val for i in b.meta["index"].tolist()]
    assert val_weighted == val_plain
    with pytest.raises(TaskWeightsError, match="not a task of"):
        pipeline({"open the door": 2})
