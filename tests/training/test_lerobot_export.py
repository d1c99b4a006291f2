"""LeRobot's processor files in pretrained_model/, the tokenizer a run uses, and their conversion script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _trainer_runs import ROOT, run_in_process, tiny_overrides
from safetensors.numpy import load_file

from vla.data.lerobot_processor import (
    NORMALIZER_FILE,
    PALIGEMMA_TOKENIZER,
    PROCESSOR_FILES,
    UNNORMALIZER_FILE,
    processor_documents,
    write_lerobot_processor,
)

EXAMPLE = ROOT / "tests" / "fixtures" / "lerobot_pretrained_model_example"  # written by LeRobot 0.4.4


def _unflatten(tensors: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    stats: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        feature, name = key.rsplit(".", 1)
        stats.setdefault(feature, {})[name] = value
    return stats


def test_files_equal_those_lerobot_wrote_for_the_same_policy(tmp_path) -> None:
    """LeRobot 0.4.4's own files for a 2-camera MetaWorld pi0: same JSON, same tensors, bit for bit."""
    config = json.loads((EXAMPLE / "config.json").read_text())
    reference = load_file(str(EXAMPLE / NORMALIZER_FILE))
    written = write_lerobot_processor(
        tmp_path,
        input_features=config["input_features"],
        output_features=config["output_features"],
        norm_map=config["normalization_mapping"],
        stats=_unflatten(reference),
        tokenizer_name=PALIGEMMA_TOKENIZER,
        max_length=config["tokenizer_max_length"],
    )
    assert sorted(p.name for p in written) == sorted(PROCESSOR_FILES)
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((EXAMPLE / name).read_text()), name
    for name in (NORMALIZER_FILE, UNNORMALIZER_FILE):
        ours, theirs = load_file(str(tmp_path / name)), load_file(str(EXAMPLE / name))
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
            assert np.array_equal(ours[key], theirs[key]), key


def test_missing_stats_of_a_normalised_feature_are_refused(tmp_path) -> None:
    features = {"observation.state": {"type": "STATE", "shape": [4]}}
    with pytest.raises(ValueError, match=r"'observation.state' with MEAN_STD but its stats lack \['std'\]"):
        write_lerobot_processor(
            tmp_path,
            input_features=features,
            output_features={"action": {"type": "ACTION", "shape": [4]}},
            norm_map={"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
            stats={"observation.state": {"mean": np.zeros(4)}, "action": {"mean": [0.0], "std": [1.0]}},
            tokenizer_name="x",
            max_length=8,
        )
    pre, post = processor_documents(
        input_features=features,
        output_features={},
        norm_map={},
        tokenizer_name="t",
        max_length=8,
    )
    assert [s["registry_name"] for s in pre["steps"]][-1] == "normalizer_processor"
    assert post["steps"][0]["config"]["features"] == {}


@pytest.fixture(scope="module")
def tiny_run(synthetic_dataset, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("lerobot_export") / "run"
    run_in_process(tiny_overrides(synthetic_dataset, output, "trainer.steps=3", "trainer.checkpoint_every=3"))
    return output


def test_every_pi0_run_writes_lerobot_processor_files(tiny_run) -> None:
    from transformers import AutoTokenizer

    from vla.data.tokenizer import PromptTokenizer, load_tokenizer

    directory = tiny_run / "pretrained_model"
    assert all((directory / name).is_file() for name in PROCESSOR_FILES)
    assert not (directory / "config.json").exists()  # pi0_tiny: LeRobot cannot build that size
    processor = json.loads((tiny_run / "processor.json").read_text())
    stats = load_file(str(directory / NORMALIZER_FILE))
    # The run's normalisation statistics, as float32, under LeRobot's flat names.
    for feature, values in processor["normalizer"]["stats"].items():
        for name, value in values.items():
            np.testing.assert_array_equal(stats[f"{feature}.{name}"], np.asarray(value, dtype=np.float32))
    pre = json.loads((directory / "policy_preprocessor.json").read_text())
    tokenizer_step = pre["steps"][3]["config"]
    assert tokenizer_step["max_length"] == processor["config"]["max_prompt_length"]
    # The built-in tokenizer is saved beside them; LeRobot's AutoTokenizer loads it and gives our ids.
    assert tokenizer_step["tokenizer_name"] == str((directory / "tokenizer").resolve())
    saved = AutoTokenizer.from_pretrained(tokenizer_step["tokenizer_name"], local_files_only=True)
    ours = PromptTokenizer(load_tokenizer(None), 16)
    theirs = PromptTokenizer(saved, 16)
    assert ours.encode("Reach the red target") == theirs.encode("Reach the red target")
    features = pre["steps"][5]["config"]["features"]
    assert features["observation.images.top"] == {"type": "VISUAL", "shape": [3, 32, 32]}
    assert features["action"] == {"type": "ACTION", "shape": [4]}


def test_script_exports_a_checkpoint_like_the_run(tiny_run, tmp_path) -> None:
    """The last checkpoint exported by the script: the run's own export, bit for bit, plus processor files."""
    result = subprocess.run(
        [sys.executable, "scripts/export_lerobot.py", str(tiny_run), "--checkpoint", "step_00000003",
         "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs = (
        load_file(str(tmp_path / "out" / "policy.safetensors")),
        load_file(str(tiny_run / "policy.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    for name in PROCESSOR_FILES:
        assert (tmp_path / "out" / "pretrained_model" / name).read_bytes() != b""
    same = load_file(str(tmp_path / "out" / "pretrained_model" / NORMALIZER_FILE))
    assert same.keys() == load_file(str(tiny_run / "pretrained_model" / NORMALIZER_FILE)).keys()
    missing = subprocess.run(
        [sys.executable, "scripts/export_lerobot.py", str(tmp_path / "nothing")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "no processor.json" in missing.stderr


def test_a_checkpoint_export_is_the_run_s_export_byte_for_byte_and_plays_its_replan_interval(
    tiny_run, tmp_path, monkeypatch
) -> None:
    """Exports are a function of the weights (the run's last checkpoint gives the run's own file, sha256
    and all), and LeRobot's n_action_steps is the run's trainer.closed_loop.replan_every."""
    from vla.eval.policy_runner import run_replan_every
    from vla.training import export

    asked: list[int | None] = []
    monkeypatch.setattr(
        export, "lerobot_config_for", lambda *a, **k: asked.append(a[3])
    )  # pi0_tiny: no config
    out = export.export_checkpoint(tiny_run, "step_00000003", out=tmp_path / "out")
    assert (out / "policy.safetensors").read_bytes() == (tiny_run / "policy.safetensors").read_bytes()
    assert (out / "policy.safetensors.sha256").read_text() == (
        tiny_run / "policy.safetensors.sha256"
    ).read_text()
    assert asked == [5] and run_replan_every(tiny_run) == 5
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    config = (copy / "config.yaml").read_text()
    assert config.count("replan_every: 5") == 1
    (copy / "config.yaml").write_text(config.replace("replan_every: 5", "replan_every: 3"))
    export.export_checkpoint(copy, "step_00000003", out=tmp_path / "out3")
    assert asked == [5, 3] and run_replan_every(copy) == 3


def test_saved_tokenizer_loads_under_transformers_4(tiny_run) -> None:
    """transformers 5 records "TokenizersBackend" as the class, which LeRobot 0.4's transformers 4.x cannot
    load (found against the real LeRobot 0.4.4); the saved copy names PreTrainedTokenizerFast."""
    saved = json.loads((tiny_run / "pretrained_model" / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_processor_files_carry_the_run_s_eps(tiny_run, tmp_path) -> None:
    """A run saved before LeRobot's eps (1e-6 in processor.json) is exported with 1e-6, not LeRobot's 1e-8:
    LeRobot's normaliser then gives our state to float precision (with 1e-8 it differed by 2.5e-5)."""
    from vla.training.export import export_for_lerobot

    run = tmp_path / "legacy_run"
    run.mkdir()
    for name in ("config.yaml", "policy.safetensors", "policy.safetensors.sha256"):
        (run / name).write_bytes((tiny_run / name).read_bytes())
    processor = json.loads((tiny_run / "processor.json").read_text())
    assert processor["normalizer"]["eps"] == 1e-8
    del processor["normalizer"]["eps"]  # as runs wrote it before
    (run / "processor.json").write_text(json.dumps(processor))
    directory = export_for_lerobot(run)
    for name, index in (("policy_preprocessor.json", 5), ("policy_postprocessor.json", 0)):
        steps = json.loads((directory / name).read_text())["steps"]
        assert steps[index]["config"]["eps"] == 1e-6
    fresh = json.loads((tiny_run / "pretrained_model" / "policy_preprocessor.json").read_text())
    assert fresh["steps"][5]["config"]["eps"] == 1e-8


def test_parity_script_records_frames_noise_and_our_actions(tiny_run, tmp_path) -> None:
    """Step 1 of scripts/check_lerobot_parity.py (step 2 needs a LeRobot venv): the actions it records are
    the policy runner's for the recorded noise, and the frames are the dataset's."""
    import torch
    from safetensors.torch import load_file as load_tensors

    from vla.data.reader import LeRobotDataset
    from vla.eval.policy_runner import load_run_policy, run_dataset_root

    result = subprocess.run(
        [sys.executable, "scripts/check_lerobot_parity.py", "ours", "--run", str(tiny_run), "--frames", "2",
         "--out", str(tmp_path / "parity")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "parity" / "parity.json").read_text())
    assert manifest["lerobot_model"] is False and len(manifest["indices"]) == 2
    recorded = load_tensors(str(tmp_path / "parity" / "parity.safetensors"))
    actor = load_run_policy(tiny_run)
    reader = LeRobotDataset(run_dataset_root(tiny_run))
    for frame, index in enumerate(manifest["indices"]):
        item = reader[index]
        for key in manifest["keys"]:
            assert torch.equal(recorded[f"{frame}/item/{key}"], item[key])
        noise = recorded[f"{frame}/noise"].unsqueeze(0)
        again = actor.sample([item], noise=noise)
        np.testing.assert_array_equal(recorded[f"{frame}/actions"].numpy(), again[0])
        other = actor.sample([item], noise=torch.randn_like(noise))
        assert not np.allclose(other, again)  # the given noise is what was used
        np.testing.assert_allclose(
            recorded[f"{frame}/unnormalised"].numpy(),
            actor.processor.unnormalize_actions(recorded[f"{frame}/normalised"]).numpy(),
            rtol=0, atol=1e-6,
        )  # fmt: skip
