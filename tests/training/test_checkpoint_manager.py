"""CheckpointManager in one process: exact resume, atomic saves, pruning, resolve(), errors, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from _checkpoint_workers import (
    M_STEPS,
    N_STEPS,
    OPTIMIZERS,
    build,
    draws,
    probe_outputs,
    seed_rank_rngs,
    train,
)
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from vla.models import config_from_dict
from vla.training.checkpoint import CheckpointError, CheckpointManager, read_safetensors_metadata
from vla.training.export import write_export, write_safetensors

REPO = Path(__file__).resolve().parents[2]


def _linear_run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _linear_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_state_equal(got: object, expected: object, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            _assert_state_equal(got[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _assert_state_equal(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_resume_continues_the_uninterrupted_run_bitwise(tmp_path: Path, kind: str) -> None:
    manager = CheckpointManager(tmp_path)
    policy, opt, scheduler = build(kind)
    seed_rank_rngs(5)
    # Noise and flow time come from the global RNG here, so the trajectory depends on its restore.
    train(policy, opt, scheduler, range(N_STEPS), global_rng=True)
    saved = manager.save(
        N_STEPS, policy, opt, scheduler=scheduler, trainer_state={"epoch": 2, "index": 17, "loss": [0.5]}
    )
    expected_lrs = train(policy, opt, scheduler, range(N_STEPS, N_STEPS + M_STEPS), global_rng=True)
    expected_draws = draws()
    expected_params = _params(policy)
    expected_opt = opt.state_dict()

    fresh, fresh_opt, fresh_scheduler = build(kind, seed=7)
    seed_rank_rngs(99)
    state = manager.load(saved, fresh, fresh_opt, scheduler=fresh_scheduler)
    assert state == {"epoch": 2, "index": 17, "loss": [0.5], "step": N_STEPS}
    lrs = train(fresh, fresh_opt, fresh_scheduler, range(N_STEPS, N_STEPS + M_STEPS), global_rng=True)

    assert lrs == expected_lrs and len(set(lrs)) == M_STEPS  # the schedule moves and continues
    got_draws = draws()
    assert got_draws["python"] == expected_draws["python"]
    assert np.array_equal(got_draws["numpy"], expected_draws["numpy"])
    assert torch.equal(got_draws["torch"], expected_draws["torch"])
    got = _params(fresh)
    for name, value in expected_params.items():
        assert torch.equal(got[name], value), f"{kind}: {name} differs after resume"
    _assert_state_equal(fresh_opt.state_dict(), expected_opt, kind)
    # The check has teeth: without the RNG restore the same M steps land elsewhere.
    other, other_opt, other_scheduler = build(kind, seed=7)
    manager.load(saved, other, other_opt, scheduler=other_scheduler, restore_rng=False)
    train(other, other_opt, other_scheduler, range(N_STEPS, N_STEPS + M_STEPS), global_rng=True)
    assert not all(torch.equal(v, expected_params[k]) for k, v in _params(other).items())


def test_saving_before_the_first_step_does_not_touch_the_optimizer(tmp_path: Path) -> None:
    class Wrapper(torch.optim.Optimizer):  # shaped like Accelerate's AcceleratedOptimizer
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        param_groups = property(lambda self: self.optimizer.param_groups)
        state = property(lambda self: self.optimizer.state)

    manager = CheckpointManager(tmp_path)
    model, opt = _linear_run()
    saved = manager.save(0, model, Wrapper(opt))
    assert not opt.state  # get_state_dict's zero-lr initialisation step did not run
    assert manager.read_manifest(saved)["optimizer"] == "empty"
    for step in range(2):
        _linear_step(model, opt, step)

    fresh, fresh_opt = _linear_run(seed=1)
    assert manager.load(saved, fresh, Wrapper(fresh_opt)) == {"step": 0}
    assert not fresh_opt.state
    for step in range(2):
        _linear_step(fresh, fresh_opt, step)
    _assert_state_equal(_params(fresh), _params(model))
    _assert_state_equal(fresh_opt.state_dict(), opt.state_dict())


def test_an_exception_mid_save_leaves_the_previous_checkpoint_and_no_tmp_dir(tmp_path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path)
    model, opt = _linear_run()
    _linear_step(model, opt, 0)
    first = manager.save(1, model, opt)
    _linear_step(model, opt, 1)

    seen_shards: list[str] = []

    def failing_finish(self, metadata, results):
        seen_shards.extend(p.name for p in Path(self.path).glob("*.distcp"))
        raise OSError("disk quota exceeded (simulated)")

    monkeypatch.setattr(FileSystemWriter, "finish", failing_finish)
    with pytest.raises(
        CheckpointError, match=r"(?s)saving step 2: writing the model/optimizer shards.*quota exceeded"
    ):
        manager.save(2, model, opt)
    assert seen_shards  # the failure hit after shards had been written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert manager.latest() == first and manager.checkpoints() == [first]

    monkeypatch.undo()
    fresh, fresh_opt = _linear_run(seed=1)
    manager.load(first, fresh, fresh_opt)
    assert manager.save(2, model, opt) == manager.path_for(2)


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os
        import torch
        from torch import nn
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from vla.training.checkpoint import CheckpointManager

        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        manager = CheckpointManager({str(tmp_path)!r})
        manager.save(1, model, opt)
        FileSystemWriter.finish = lambda self, metadata, results: os._exit(17)  # dies after the shards
        manager.save(2, model, opt)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr

    manager = CheckpointManager(tmp_path)
    leftover = tmp_path / ".tmp_step_00000002"
    assert list((leftover / "model_optim").glob("*.distcp"))  # half-written, never renamed
    assert manager.checkpoints() == [manager.path_for(1)] and manager.latest() == manager.path_for(1)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resolve(str(leftover))

    model, opt = _linear_run()
    manager.load(manager.latest(), model, opt)  # the previous checkpoint is intact
    _linear_step(model, opt, 0)
    manager.save(3, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_extra_state_is_loaded_in_place(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    model, opt = _linear_run()
    _linear_step(model, opt, 0)
    shadow = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    saved = manager.save(1, model, opt, extra_state={"ema": shadow, "updates": 3})
    assert manager.read_manifest(saved)["extra_state"] == ["ema", "updates"]

    fresh, fresh_opt = _linear_run(seed=1)
    live = {n: torch.zeros_like(p) for n, p in fresh.named_parameters()}
    extra = {"ema": live, "updates": 0}
    manager.load(saved, fresh, fresh_opt, extra_state=extra)
    for name, value in shadow.items():
        assert extra["ema"][name] is live[name] and torch.equal(live[name], value)
    assert extra["updates"] == 3
    with pytest.raises(CheckpointError, match=r"holds no extra state \['swa'\]"):
        manager.load(saved, fresh, fresh_opt, extra_state={"swa": {}})


def test_keep_last_prunes_old_checkpoints_and_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    model, opt = _linear_run()
    for step in range(1, 5):
        _linear_step(model, opt, step)
        manager.save(step, model, opt, trainer_state={"step": step, "version": "first"})
    assert [p.name for p in manager.checkpoints()] == ["step_00000003", "step_00000004"]

    manager.save(4, model, opt, trainer_state={"version": "second"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert manager.load(manager.latest(), *_linear_run())["version"] == "second"

    # An older step saved into a root holding later ones (resumed from an explicit older path) is kept,
    # and the user is told that resume=auto would pick the later one.
    with pytest.warns(UserWarning, match=r"later checkpoints \(step_00000003, step_00000004\)"):
        kept = manager.save(2, model, opt)
    assert manager.checkpoints() == [kept, manager.path_for(3), manager.path_for(4)]

    everything = CheckpointManager(tmp_path / "all", keep_last=None)
    for step in range(5):
        everything.save(step, model, opt)
    assert len(everything.checkpoints()) == 5
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        CheckpointManager(tmp_path, keep_last=0)


def test_resolve(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run")
    assert manager.resolve("auto") is None  # root does not even exist yet: a fresh start
    for off in (None, "", "none", "None"):
        assert manager.resolve(off) is None
    with pytest.raises(FileNotFoundError, match=r"'/nope/step_1'.*does not exist.*none under"):
        manager.resolve("/nope/step_1")

    model, opt = _linear_run()
    _linear_step(model, opt, 0)
    for step in (5, 10):
        manager.save(step, model, opt)
    (manager.root / "step_00000020").mkdir()  # not written by a save: no manifest
    with pytest.warns(UserWarning, match=r"resume=auto skips step_00000020: .*manifest.json is missing"):
        assert manager.resolve("auto") == manager.path_for(10)
    assert [p.name for p, _ in manager.skipped] == ["step_00000020"]
    assert manager.resolve("step_00000005") == manager.path_for(5)  # relative to root
    assert manager.resolve(str(manager.path_for(5))) == manager.path_for(5)
    with pytest.raises(FileNotFoundError) as info:
        manager.resolve("step_00000020")
    message = str(info.value)
    assert "not a complete checkpoint" in message
    assert str(manager.path_for(5)) in message and str(manager.path_for(10)) in message
    assert "trainer.resume=auto" in message


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    model, opt = _linear_run()
    _linear_step(model, opt, 0)
    weights_only = manager.save(1, model)
    with pytest.raises(CheckpointError, match=r"holds no optimizer state.*pass optimizer=None"):
        manager.load(weights_only, *_linear_run())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(CheckpointError, match="holds no scheduler state"):
        manager.load(weights_only, model, scheduler=scheduler)
    with pytest.raises(CheckpointError, match=r"does not exist.*Available checkpoints"):
        manager.load(tmp_path / "step_00000042", model)

    full = manager.save(2, model, opt)
    wider = nn.Linear(4, 5)
    with pytest.raises(CheckpointError, match="does the model and its optimizer's param groups match"):
        manager.load(full, wider, torch.optim.AdamW(wider.parameters()))
    stray = torch.optim.AdamW(nn.Linear(4, 3).parameters())
    with pytest.raises(CheckpointError, match="Build the optimizer after wrapping the model"):
        manager.save(3, model, stray)
    assert manager.checkpoints() == [weights_only, full]
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        manager.save(-1, model)


def test_export_round_trip_single_process(tmp_path: Path) -> None:
    from vla.eval.policy_runner import load_exported_policy

    policy, opt, scheduler = build("muon")
    train(policy, opt, scheduler, range(1))
    path = write_export(policy.state_dict(), policy.config, tmp_path / "out")
    assert not [p.name for p in path.parent.iterdir() if ".tmp" in p.name]  # no temporary file left
    meta = read_safetensors_metadata(path)
    assert meta["vla.layout"] == "lerobot_pi0"
    assert config_from_dict(json.loads(meta["policy_config"])) == policy.config
    assert torch.equal(probe_outputs(load_exported_policy(path)), probe_outputs(policy))


def test_safetensors_store_tied_weights_once(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    model = Tied()
    path = write_safetensors(
        model.state_dict(), tmp_path / "tied.safetensors", {"format": "pt", "note": "toy"}
    )
    meta = read_safetensors_metadata(path)
    assert json.loads(meta["tied"]) == {"head.weight": "embed.weight"} and meta["note"] == "toy"
    assert set(load_file(str(path))) == {"embed.weight"}  # stored once
    assert torch.equal(load_file(str(path))["embed.weight"], model.embed.weight.detach())
