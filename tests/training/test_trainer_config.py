"""Every config combination composes and validates; bad configs fail at start-up naming the key and fix."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from _trainer_runs import run_in_process, tiny_overrides

from vla.training.config import compose, compose_many, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.slow
def test_every_group_combination_composes_and_validates() -> None:
    combos = list(
        itertools.product(_options("model"), _options("optim"), _options("data"), _options("parallel"))
    )
    override_sets = []
    for model, optim, data, parallel in combos:
        overrides = [f"model={model}", f"optim={optim}", f"data={data}", f"parallel={parallel}"]
        if data == "lerobot":
            overrides.append("data.root=/datasets/aloha")
        override_sets.append(overrides)
    for (model, optim, data, parallel), cfg in zip(combos, compose_many(override_sets)):
        assert (cfg.model.preset, cfg.optim.name, cfg.data.source, cfg.parallel.mode) == (
            model,
            optim,
            data,
            parallel,
        )
        validate(cfg, world_size=1 if parallel == "none" else 2)
    assert len(combos) == 6 * 3 * 2 * 3


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_experiments_and_debug_configs_compose(experiment: str) -> None:
    cfg = compose([f"experiment={experiment}", "data.root=/datasets/x"])
    validate(cfg, world_size=1 if cfg.parallel.mode == "none" else 2)
    assert compose(["debug=fast"]).model.preset == "pi0_tiny"


def test_command_line_overrides_reach_the_schema() -> None:
    cfg = compose(
        ["model=pi0", "optim=dmuon", "optim.lr=0.01", "data=lerobot", "data.root=/x", "trainer.steps=2000"]
    )
    assert (cfg.model.preset, cfg.optim.lr, cfg.data.root, cfg.trainer.steps) == ("pi0", 0.01, "/x", 2000)
    assert cfg.output_dir.startswith("outputs/pi0-dmuon/")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["+trainer.stepz=3"], "unknown config key trainer.stepz \\(did you mean trainer.steps"),
        (["trainer.steps=abc"], "trainer.steps"),  # a wrong type
        (["optim.name=dmoun"], "did you mean 'dmuon'"),
        (["trainer.precision=fp8"], "trainer.precision"),
        (["data=lerobot"], "missing required config values: \\['data.root'\\]"),
        (["trainer.warmup_steps=500"], "warmup_steps"),
        (["trainer.ema_decay=1.5"], "ema_decay"),
        (["parallel.mode=zero3"], "parallel.mode"),
    ],
)
def test_bad_values_fail_while_composing(overrides: list[str], match: str) -> None:
    with pytest.raises(Exception, match=match):
        compose(overrides)


@pytest.mark.parametrize(
    ("overrides", "world", "match"),
    [
        (["parallel=fsdp2"], 1, "parallel=fsdp2 needs several processes.*torchrun"),
        (["parallel=none"], 2, "pick parallel=ddp or parallel=fsdp2"),
        (["parallel=ddp", "trainer.batch_size=6"], 4, "trainer.batch_size=6 must divide by world size"),
        (["model=openvla_tiny", "model.train_expert_only=true"], 1, "train_expert_only applies to pi0"),
    ],
)
def test_impossible_combinations_are_rejected(overrides: list[str], world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(compose(overrides), world_size=world)


def test_a_dataset_without_the_models_camera_fails_at_start_up(
    synthetic_dataset: Path, tmp_path: Path
) -> None:
    overrides = tiny_overrides(synthetic_dataset, tmp_path / "run", "trainer.steps=2")
    overrides.append("data.camera_map={observation.images.top: top, observation.images.side: wrist}")
    with pytest.raises(Exception, match=r"observation\.images\.side"):
        run_in_process(overrides)


def test_a_wrong_dataset_root_names_the_path(tmp_path: Path) -> None:
    overrides = tiny_overrides(tmp_path / "nowhere", tmp_path / "run", "data=lerobot", "trainer.steps=2")
    with pytest.raises(FileNotFoundError, match=r"nowhere.*meta/info\.json"):
        run_in_process(overrides)
