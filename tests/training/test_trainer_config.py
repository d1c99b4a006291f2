"""Every config combination composes and validates; bad configs fail at start-up naming the key and fix."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import torch
from _trainer_runs import run_in_process, tiny_overrides

from vla.training.cli import compose, compose_many
from vla.training.config import validate

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.slow
def test_every_group_combination_composes_and_validates() -> None:
    """Every model x optim x data combination composes (Hydra), and each of them validates with every
    parallel mode: the parallel group is composed once per option and swapped in, as nothing in it
    interpolates the other groups (a full compose each costs ~0.2 s: 315 of them took a minute)."""
    import copy

    parallel_configs = {
        mode: cfg.parallel
        for mode, cfg in zip(
            _options("parallel"), compose_many([[f"parallel={mode}"] for mode in _options("parallel")])
        )
    }
    combos = list(itertools.product(_options("model"), _options("optim"), _options("data")))
    override_sets = []
    for model, optim, data in combos:
        overrides = [f"model={model}", f"optim={optim}", f"data={data}"]
        if data == "lerobot":
            overrides.append("data.root=/datasets/aloha")
        override_sets.append(overrides)
    validated = 0
    for (model, optim, data), cfg in zip(combos, compose_many(override_sets)):
        assert (cfg.model.preset, cfg.optim.name, cfg.data.source) == (model, optim, data)
        for parallel, parallel_config in parallel_configs.items():
            combined = dataclasses.replace(cfg, parallel=copy.deepcopy(parallel_config))
            assert combined.parallel.mode == parallel
            world = {"none": 1, "auto": 1, "hsdp": 4}.get(parallel, 2)  # hsdp: 2 replicas x 2 shards
            if parallel == "hsdp":
                combined.parallel.replicas = 2
            validate(combined, world_size=world)
            validated += 1
    assert validated == 7 * 3 * 3 * 5  # 7 model presets, 3 optimizers, 3 data sources, 5 parallel modes


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_experiments_and_debug_configs_compose(experiment: str) -> None:
    cfg = compose(
        [f"experiment={experiment}", "data.root=/datasets/x", "model.weights=/weights/x.safetensors"]
    )
    validate(cfg, world_size=1 if cfg.parallel.mode in ("none", "auto") else 2)
    assert compose(["debug=fast"]).model.preset == "pi0_tiny"


def test_an_experiments_learning_rates_follow_the_chosen_optimizer() -> None:
    # The MetaWorld presets were tuned with DMuon (0.01): optim=adamw gets AdamW's lr from
    # configs/experiment_optim, never DMuon's; an lr on the command line still wins.
    sets = [
        [f"experiment={experiment}", f"optim={optim}", "model.weights=/w.safetensors"]
        for experiment in ("metaworld", "metaworld_long", "metaworld_finetune")
        for optim in ("dmuon", "muon", "adamw")
    ]
    sets += [["experiment=metaworld", "optim=adamw", "optim.lr=0.123"], ["optim=adamw"], ["experiment=demo"]]
    lrs = [(cfg.optim.name, cfg.optim.lr, cfg.optim.adamw_lr) for cfg in compose_many(sets)]
    first_stage = [("dmuon", 0.01, 5e-4), ("muon", 0.01, 5e-4), ("adamw", 1e-3, 1e-3)]
    second_stage = [("dmuon", 0.002, 1e-4), ("muon", 0.002, 1e-4), ("adamw", 2e-4, 1e-3)]
    assert lrs == [
        *first_stage,
        *first_stage,
        *second_stage,
        ("adamw", 0.123, 1e-3),
        ("adamw", 1e-3, 1e-3),
        ("dmuon", 0.02, 1e-3),
    ]
    # The group is optional, so a misnamed file would be skipped in silence: every file names an
    # experiment and an optimizer that exist.
    pairs = {f"{e}_{o}" for e in _options("experiment") for o in _options("optim")}
    assert set(_options("experiment_optim")) <= pairs, set(_options("experiment_optim")) - pairs


def test_metaworld_long_is_the_measured_run() -> None:
    # experiment=metaworld_long reproduces docs/ablations/tgs400_start_nostate_steps16000 (a 4000-step run
    # continued to 10000, then to 16000): every setting of its trajectory, in one run whose schedule is
    # lengthened at 4000 and 10000.
    from omegaconf import OmegaConf

    from vla.training.resume import compare_config, flatten

    saved = flatten(
        OmegaConf.to_container(
            OmegaConf.load(ROOT / "docs/ablations/tgs400_start_nostate_steps16000/config.yaml"), resolve=True
        )
    )
    cfg = compose(["experiment=metaworld_long", f"data.root={saved['data.root']}"])
    problems, _ = compare_config(saved, cfg)
    assert problems == ["trainer.lengthen_schedule_at: [] -> [4000, 10000]"]
    assert (cfg.trainer.steps, cfg.data.metaworld.hand_start_noise, cfg.model.overrides["use_state"]) == (
        16000,
        0.1,
        False,
    )


def test_metaworld_finetune_is_the_measured_fine_tune_and_needs_its_weights() -> None:
    # experiment=metaworld_finetune reproduces the fine-tunes measured in docs/ablations/after10_finetune
    # (control/ and control/seed1/: the step-16000 export of metaworld_long fine-tuned on its own
    # demonstrations) setting for setting, but the training seed.
    from omegaconf import OmegaConf

    from vla.training.resume import compare_config, flatten

    measured = ROOT / "docs/ablations/after10_finetune/control"
    for saved_config, seed in ((measured / "config.yaml", 0), (measured / "seed1" / "config.yaml", 1)):
        saved = flatten(OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True))
        given = [f"model.weights={saved['model.weights']}", f"data.root={saved['data.root']}"]
        cfg = compose(["experiment=metaworld_finetune", *given, f"trainer.seed={seed}"])
        problems, _ = compare_config(saved, cfg)
        assert problems == [], saved_config
    default, first_stage = compose_many(
        [["experiment=metaworld_finetune", "model.weights=/w.safetensors"], ["experiment=metaworld_long"]]
    )
    assert default.data == first_stage.data  # the first stage's dataset, recorded once
    assert (default.trainer.steps, default.trainer.lengthen_schedule_at, default.optim.lr) == (
        2000,
        [],
        0.002,
    )

    # Without weights it would train a policy from scratch for 2000 steps: it stops, naming the key.
    with pytest.raises(ValueError, match=r"missing required config values: \['model.weights'\]") as missing:
        compose(["experiment=metaworld_finetune"])
    assert "model.weights=RUN/policy.safetensors" in str(missing.value)
    assert "experiment=metaworld_long" in str(missing.value)


def test_metaworld_maps_each_recorded_camera_onto_the_model_camera_of_its_name() -> None:
    default, side, explicit = compose_many(
        [
            ["experiment=metaworld"],
            ["experiment=metaworld", "data.metaworld.cameras=[workspace_side,gripperPOV]"],
            ["experiment=metaworld", "data.camera_map={observation.images.corner2: topview}"],
        ]
    )
    assert default.data.camera_map == {
        "observation.images.corner2": "corner2",
        "observation.images.topview": "topview",
    }
    assert side.data.camera_map == {
        "observation.images.workspace_side": "workspace_side",
        "observation.images.gripperPOV": "gripperPOV",
    }
    assert explicit.data.camera_map == {"observation.images.corner2": "topview"}  # a given map is kept
    assert compose(["data=synthetic"]).data.camera_map  # other sources keep their config's map


def test_command_line_overrides_reach_the_schema() -> None:
    cfg = compose(
        ["model=pi0", "optim=dmuon", "optim.lr=0.01", "data=lerobot", "data.root=/x", "trainer.steps=2000"]
    )
    assert (cfg.model.preset, cfg.optim.lr, cfg.data.root, cfg.trainer.steps) == ("pi0", 0.01, "/x", 2000)
    # Hydra's run directory (hydra.run.dir, made absolute as Hydra does)
    assert cfg.output_dir.startswith(str(Path.cwd() / "outputs" / "pi0-dmuon") + "/")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["+trainer.stepz=3"], "unknown config key trainer.stepz \\(did you mean trainer.steps"),
        (["trainer.steps=abc"], "trainer.steps"),  # a wrong type
        (["optim.name=dmoun"], "did you mean 'dmuon'"),
        (["trainer.precision=fp8"], "trainer.precision"),
        (
            ["data=lerobot"],
            r"data.root is not set: give a local LeRobot dataset \(data.root=/path/to/dataset\) or a hub id \(data.repo_id=org/name\)",
        ),
        (["trainer.ema_decay=1.5"], "ema_decay"),
        (["parallel.mode=zero3"], "parallel.mode"),
        (["data.frame_cache_mb=-1"], r"data.frame_cache_mb must be >= 0, got -1"),
        (
            ["data.task_weights={reach the goal: -1}"],
            r"data.task_weights\['reach the goal'\] is -1.0: a weight is",
        ),
    ],
)
def test_bad_values_fail_while_composing(overrides: list[str], match: str) -> None:
    with pytest.raises(Exception, match=match):
        compose(overrides)


def test_parallel_auto_is_the_default_and_resolves_by_the_launch() -> None:
    from vla.models import build_policy
    from vla.training.parallel import resolve_auto

    parallel = compose([]).parallel
    assert parallel.mode == "auto"
    policy = build_policy("pi0_tiny")
    assert resolve_auto(parallel, 1, policy)[0].mode == "none"
    resolved, note = resolve_auto(parallel, 4, policy)
    assert resolved.mode == "fsdp2" and note == "parallel=auto: 4 process(es) -> parallel=fsdp2"
    assert resolve_auto(parallel, 4, torch.nn.Linear(2, 2))[0].mode == "ddp"  # nothing FSDP2 could shard
    assert resolve_auto(compose(["parallel=ddp"]).parallel, 4, policy) == (
        compose(["parallel=ddp"]).parallel,
        None,
    )


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


# ------------------------------------------------------------------------------------------------------
# Command lines as documented (issue 11)

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS = README.parent / "docs"


def _documented_command_lines() -> list[list[str]]:
    """The overrides of every `train.py` command line in the README's, docs/'s and configs' examples; a
    sweep (`-m`, comma-separated values) contributes each of its jobs."""
    import shlex

    texts = [README.read_text()] + [p.read_text() for p in sorted(DOCS.rglob("*.md"))]
    texts += [p.read_text() for p in CONFIGS.rglob("*.yaml")]
    lines = []
    for text in texts:
        joined = text.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.lstrip("# ").strip()
            if "train.py" not in line or line.startswith(("Multi-process", '"""')):
                continue
            words = shlex.split(line.split("train.py", 1)[1].split(" #")[0].split("`")[0])
            overrides = [w for w in words if "=" in w and not w.startswith("-")]
            sweeps = [o for o in overrides if "," in o.split("=", 1)[1] and "{" not in o]
            if "-m" in words and sweeps:
                key, values = sweeps[0].split("=", 1)
                rest = [o for o in overrides if o != sweeps[0]]
                lines.extend([*rest, f"{key}={value}"] for value in values.split(","))
            else:
                lines.append(overrides)
    # Dict overrides quoted on their own in the text ('model.overrides={vlm: {depth: 4}}').
    for text in texts:
        lines.extend([m] for m in re.findall(r"'([a-z_]+\.[a-z_.]+=\{[^']*\})'", text))
    return lines


def test_every_documented_command_line_composes() -> None:
    lines = _documented_command_lines()
    assert len(lines) >= 12, lines
    # The ablations' record (docs/ablations/README.md) keeps its commands: they are checked too.
    assert ["experiment=metaworld", "data.metaworld.episodes=400"] in lines
    joined = [" ".join(o) for o in lines]
    assert any("data.camera_map={observation.images.cam_high: base_0_rgb" in j for j in joined)
    assert any("model.overrides={vlm: {depth: 4}}" in j for j in joined)
    override_sets = [
        [*o, "data.root=/datasets/x"] if not any(w.startswith("data.root=") for w in o) else o for o in lines
    ]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fields = {
        "data.camera_map": lambda c: c.data.camera_map,
        "data.norm_modes": lambda c: c.data.norm_modes,
        "model.overrides": lambda c: c.model.overrides,
        "trainer.steps": lambda c: c.trainer.steps,
    }
    for overrides, cfg in zip(override_sets, compose_many(override_sets)):
        for parsed in parser.parse_overrides(overrides):
            if parsed.key_or_group in fields:  # exactly the command line's value (dicts replace the preset's)
                assert fields[parsed.key_or_group](cfg) == parsed.value(), overrides


def test_task_weights_take_a_dict_of_task_texts() -> None:
    cfg = compose(["data.task_weights={reach the goal: 3, push the puck to the goal: 0.5}"])
    assert dict(cfg.data.task_weights) == {"reach the goal": 3.0, "push the puck to the goal": 0.5}
    assert dict(compose([]).data.task_weights) == {}


def test_a_plain_dict_override_replaces_the_presets_dict() -> None:
    cfg, forced, model, norm = compose_many(
        [
            ["data.camera_map={observation.images.top: top}"],  # synthetic maps two cameras
            ["++data.camera_map={observation.images.cam: wrist}"],
            ["model.overrides={vlm: {depth: 4}, action_horizon: 8}"],
            ["data.norm_modes={action: MIN_MAX, observation.state: IDENTITY}"],
        ]
    )
    assert cfg.data.camera_map == {"observation.images.top": "top"}
    assert forced.data.camera_map == {"observation.images.cam": "wrist"}
    assert model.model.overrides == {"vlm": {"depth": 4}, "action_horizon": 8}
    assert norm.data.norm_modes == {"action": "MIN_MAX", "observation.state": "IDENTITY"}
    assert compose(["model=pi0_tiny", "model.overrides={vlm: {depth: 4}}"]).model.policy_overrides() == {
        "vlm": {"depth": 4}
    }
    with pytest.raises(Exception, match=r"data.norm_modes\['action'\]"):
        compose(["data.norm_modes={action: MEANSTD}"])


def test_norm_modes_override_the_policy_defaults_per_feature() -> None:
    from vla.models import build_policy
    from vla.training.data import processor_config

    config = build_policy("pi0_tiny").config
    default = processor_config(compose([]).data, config).norm_modes
    assert default == {"observation.state": "MEAN_STD", "action": "MEAN_STD"}
    changed = processor_config(compose(["data.norm_modes={action: MIN_MAX}"]).data, config).norm_modes
    assert changed == {"observation.state": "MEAN_STD", "action": "MIN_MAX"}


def test_the_output_directory_is_hydras() -> None:
    default, run_dir, explicit, named = compose_many(
        [[], ["hydra.run.dir=/tmp/runs/a"], ["output_dir=/tmp/elsewhere"], ["optim=adamw", "model=pi0_tiny"]]
    )
    assert Path(default.output_dir).parent == Path.cwd() / "outputs" / "pi0_small-dmuon"
    assert run_dir.output_dir == "/tmp/runs/a"
    assert explicit.output_dir == "/tmp/elsewhere"
    assert Path(named.output_dir).parent.name == "pi0_tiny-adamw"


def test_a_short_run_can_follow_a_longer_runs_schedule() -> None:
    from vla.training.optim import lr_multiplier

    long, short = (
        compose(["trainer.steps=1000", "trainer.warmup_steps=50"]).trainer,
        compose(["trainer.steps=30", "trainer.schedule_steps=1000", "trainer.warmup_steps=50"]).trainer,
    )
    assert [lr_multiplier(s, short) for s in range(30)] == [lr_multiplier(s, long) for s in range(30)]
    assert lr_multiplier(
        29, compose(["trainer.steps=30", "trainer.warmup_steps=3"]).trainer
    ) == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"trainer\.schedule_steps=20 is shorter than trainer\.steps=30"):
        compose(["trainer.steps=30", "trainer.schedule_steps=20"])


def test_lengthen_schedule_at_follows_a_run_continued_to_more_steps() -> None:
    from vla.training.optim import lr_multiplier

    def trainer(*args: str):
        return compose(["trainer.warmup_steps=50", *args]).trainer

    first, second, third = (
        trainer("trainer.steps=4000"),
        trainer("trainer.steps=8000"),
        trainer("trainer.steps=10000"),
    )
    staged = trainer("trainer.steps=10000", "trainer.lengthen_schedule_at=[4000,8000]")
    expected = [lr_multiplier(s, first) for s in range(4000)]
    expected += [lr_multiplier(s, second) for s in range(4000, 8000)]
    expected += [lr_multiplier(s, third) for s in range(8000, 10000)]
    assert [lr_multiplier(s, staged) for s in range(10000)] == expected
    assert lr_multiplier(3999, staged) == pytest.approx(0.1) and lr_multiplier(4000, staged) > 0.5
    assert lr_multiplier(9999, staged) == pytest.approx(0.1)
    for bad in ("[8000,4000]", "[4000,4000]", "[40]", "[10000]", "[12000]"):
        with pytest.raises(ValueError, match=r"trainer\.lengthen_schedule_at=.* must rise strictly"):
            trainer("trainer.steps=10000", f"trainer.lengthen_schedule_at={bad}")
    # a short check run of a staged schedule: its end lies inside schedule_steps
    check = trainer(
        "trainer.steps=4500", "trainer.schedule_steps=10000", "trainer.lengthen_schedule_at=[4000]"
    )
    once = trainer("trainer.steps=10000", "trainer.lengthen_schedule_at=[4000]")
    assert [lr_multiplier(s, check) for s in range(4500)] == [lr_multiplier(s, once) for s in range(4500)]


def test_a_warmup_longer_than_the_run_is_clamped() -> None:
    from vla.training.optim import effective_warmup, lr_multiplier

    short = compose(["trainer.steps=6"]).trainer  # the default warmup is 10 steps
    assert short.warmup_steps == 10
    warmup, note = effective_warmup(short)
    assert warmup == 0 and "trainer.warmup_steps=10 is not shorter than the schedule (6 steps)" in note
    assert [round(lr_multiplier(s, short), 6) for s in (0, 5)] == [1.0, 0.1]
    longer = compose(["trainer.steps=40", "trainer.warmup_steps=40"]).trainer
    assert effective_warmup(longer)[0] == 4
    assert lr_multiplier(0, longer) == pytest.approx(1 / 5) and lr_multiplier(4, longer) == 1.0
    kept = compose(["trainer.steps=40", "trainer.warmup_steps=39"]).trainer
    assert effective_warmup(kept) == (39, None)
