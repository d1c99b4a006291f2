"""Hub ids (datasets, weights, tokenizers) from a cache in the hub's layout, offline; the tokenizer a
model gets by default, and the refusal of one whose vocabulary is not the model's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _hub_cache import cache_repo, paligemma_sized_tokenizer
from _trainer_runs import ROOT, TINY

from vla.models.factory import resolve_config
from vla.training.config import DataConfig
from vla.training.data import check_tokenizer, resolved_tokenizer_path


@pytest.fixture(scope="module")
def paligemma_tokenizer(tmp_path_factory) -> Path:
    return paligemma_sized_tokenizer(tmp_path_factory.mktemp("tok") / "paligemma")


def _offline_env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def test_a_paligemma_vocabulary_model_gets_paligemma_s_tokenizer() -> None:
    pi0 = resolve_config("pi0")
    assert resolved_tokenizer_path(DataConfig(root="x"), pi0) == "google/paligemma-3b-pt-224"
    assert resolved_tokenizer_path(DataConfig(root="x"), resolve_config("pi0_tiny")) == "builtin"
    assert resolved_tokenizer_path(DataConfig(root="x", tokenizer_path="/t"), pi0) == "/t"


def test_a_tokenizer_that_is_not_paligemma_s_is_refused_unless_told(paligemma_tokenizer, tmp_path) -> None:
    from vla.data.tokenizer import load_tokenizer

    pi0 = resolve_config("pi0")
    with pytest.raises(
        ValueError, match=r"PaliGemma's vocabulary \(257152 ids\) but the built-in tokenizer has"
    ):
        check_tokenizer(DataConfig(root="x", tokenizer_path="builtin"), pi0)
    assert (
        len(check_tokenizer(DataConfig(root="x", tokenizer_path="builtin", check_tokenizer_vocab=False), pi0))
        < 640
    )
    small = tmp_path / "small"
    load_tokenizer(None).save_pretrained(str(small))
    with pytest.raises(ValueError, match=r"the tokenizer '.*small' has 384"):
        check_tokenizer(DataConfig(root="x", tokenizer_path=str(small)), pi0)
    assert len(check_tokenizer(DataConfig(root="x", tokenizer_path=str(paligemma_tokenizer)), pi0)) == 257_152
    # Ids past the embedding are refused whatever the switch says.
    with pytest.raises(ValueError, match=r"has 257152 ids but the model's vocab_size is 1024"):
        check_tokenizer(
            DataConfig(root="x", tokenizer_path=str(paligemma_tokenizer), check_tokenizer_vocab=False),
            resolve_config("pi0_tiny"),
        )


def test_hub_tokenizer_loads_offline_from_the_cache_and_fails_clearly_without(
    paligemma_tokenizer, tmp_path
) -> None:
    cache = tmp_path / "hub"
    files = {p.name: p for p in paligemma_tokenizer.iterdir()}
    cache_repo(cache, "google/paligemma-3b-pt-224", "model", files)
    code = (
        "from vla.data.tokenizer import load_tokenizer, PromptTokenizer; "
        "t = load_tokenizer('google/paligemma-3b-pt-224'); print(len(t), PromptTokenizer(t, 8).encode('reach the goal'))"
    )
    ok = subprocess.run(
        [sys.executable, "-c", code], env=_offline_env(cache), capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.split("\n")[0] == "257152 [2, 4, 5, 6]"
    start = time.perf_counter()
    missing = subprocess.run(
        [sys.executable, "-c", code],
        env=_offline_env(tmp_path / "empty"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0 and time.perf_counter() - start < 60
    assert "TokenizerUnavailableError" in missing.stderr and "data.tokenizer_path" in missing.stderr
    assert (
        "HF_HUB_OFFLINE is set" in missing.stderr
        and "hf download google/paligemma-3b-pt-224" in missing.stderr
    )


def test_model_pi0_stops_before_building_without_paligemma_s_tokenizer(tmp_path) -> None:
    """Offline and nothing cached: one short error naming data.tokenizer_path, in seconds (no 12 GB model)."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "train.py", "model=pi0", f"output_dir={tmp_path / 'run'}",
         "data.camera_map={observation.images.top: base_0_rgb}", "data.root=" + str(tmp_path / "data"),
         "trainer.check_memory=false"],
        cwd=ROOT, env=_offline_env(tmp_path / "empty"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "data.tokenizer_path" in result.stderr and "google/paligemma-3b-pt-224" in result.stderr
    assert time.perf_counter() - start < 120


def test_dataset_and_weights_by_hub_id_offline(synthetic_dataset, tmp_path) -> None:
    """data.repo_id and model.weights from the cache; without the cache, an error naming the fix."""
    from _trainer_runs import run_in_process, tiny_overrides

    source = tmp_path / "source"
    run_in_process(tiny_overrides(synthetic_dataset, source, "trainer.steps=2"))
    cache = tmp_path / "hub"
    dataset = cache_repo(cache, "acme/reach", "dataset", {".": synthetic_dataset})
    cache_repo(cache, "acme/reach-policy", "model", {"model.safetensors": source / "policy.safetensors",
                                                    "model.safetensors.sha256": source / "policy.safetensors.sha256"})  # fmt: skip
    args = [*TINY, "data=lerobot", "data.repo_id=acme/reach", "data.camera_map={observation.images.top: top, "
            "observation.images.wrist: wrist}", "model.weights=acme/reach-policy", "trainer.steps=1",
            ]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "train.py", *args, f"output_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=_offline_env(cache), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"root: {dataset}" in saved and "repo_id: acme/reach" in saved
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1
    assert re.search(
        r"model.weights: 88 tensors loaded from \S+models--acme--reach-policy\S+ \(acme/reach-policy\), "
        r"0 left initialised",
        run.stdout,
    )
    absent = subprocess.run(
        [sys.executable, "train.py", *args, f"output_dir={tmp_path / 'run2'}"],
        cwd=ROOT, env=_offline_env(tmp_path / "empty"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert absent.returncode == 1 and "Traceback" not in absent.stderr
    assert "data.repo_id=acme/reach: not in the Hugging Face cache" in absent.stderr
    assert "hf download acme/reach --repo-type dataset" in absent.stderr
