"""Every float setting of every config group: NaN / inf / -inf (and out-of-range values) fail at
start-up with a ValueError that names the full key (issue 10 item 2).

The corpus is generated from the schema (vla.training.config), so a float field added later is
covered without touching this file.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from vla.training import config as config_module
from vla.training.cli import compose
from vla.training.config import TrainConfig, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

pytestmark = pytest.mark.timeout(120)

GROUPS = {"model", "optim", "data", "trainer", "parallel"}


def _float_keys(schema: type, prefix: str) -> list[tuple[str, str]]:
    """(key, kind) for every float-typed field, recursively; kind is "float", "pair" (tuple) or "dict"
    (a dict of floats)."""
    hints = typing.get_type_hints(schema, vars(config_module))
    keys: list[tuple[str, str]] = []
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += _float_keys(type(default), f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is dict and float in typing.get_args(hint)[1:]:
            keys.append((f"{prefix}{f.name}", "dict"))
        elif hint is float or (float in typing.get_args(hint) and typing.get_origin(hint) is not tuple):
            keys.append((f"{prefix}{f.name}", "float"))
        elif typing.get_origin(hint) is tuple and float in typing.get_args(hint):
            keys.append((f"{prefix}{f.name}", "pair"))
    return keys


FLOAT_KEYS = [k for group in GROUPS for k in _float_keys(type(getattr(TrainConfig(), group)), f"{group}.")]


def test_the_corpus_covers_the_float_settings() -> None:
    keys = {k for k, _ in FLOAT_KEYS}
    # A sanity check that the introspection finds what it should (the list may grow).
    assert {"optim.lr", "optim.betas", "optim.eps", "trainer.clip_grad_norm", "data.val_fraction"} <= keys
    assert {"trainer.min_lr_ratio", "trainer.ema_decay", "trainer.stop_grace_s", "optim.bucket_mb"} <= keys
    assert ("data.task_weights", "dict") in FLOAT_KEYS


def _expect(overrides_and_keys: list[tuple[list[str], str]]) -> list[str]:
    """Compose each override set (one Hydra initialisation); return those that did not fail naming their key."""
    failures = []
    for overrides, key in overrides_and_keys:
        try:
            compose(overrides)  # as train.py composes (Hydra's output dir, dict overrides)
        except ValueError as exc:
            if key not in str(exc):
                failures.append(f"{overrides}: error does not name {key}: {exc}")
            continue
        failures.append(f"{overrides}: accepted")
    return failures


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_fail_naming_the_key(value: str) -> None:
    cases = []
    for key, kind in FLOAT_KEYS:
        if kind == "pair":
            cases.append(([f"{key}=[0.9,{value}]"], f"{key}[1]"))
        elif kind == "dict":
            cases.append(([f"{key}={{x: {value}}}"], f"{key}['x']"))
        else:
            cases.append(([f"{key}={value}"], key))
    assert _expect(cases) == []


def test_out_of_range_values_fail_naming_the_key() -> None:
    cases = [
        (["optim.lr=-0.1"], "optim.lr"),
        (["optim.eps=0"], "optim.eps"),
        (["optim.eps=-1e-8"], "optim.eps"),
        (["optim.momentum=1.0"], "optim.momentum"),
        (["optim.bucket_mb=0"], "optim.bucket_mb"),
        (["optim.split=sometimes"], "optim.split"),
        (["optim.betas=[0.9,1.5]"], "optim.betas"),
        (["trainer.clip_grad_norm=0"], "trainer.clip_grad_norm"),
        (["trainer.clip_grad_norm=-1"], "trainer.clip_grad_norm"),
        (["trainer.steps=-3"], "trainer.steps"),
        (["trainer.batch_size=0"], "trainer.batch_size"),
        (["trainer.stop_grace_s=0"], "trainer.stop_grace_s"),
        (["trainer.min_lr_ratio=1.5"], "trainer.min_lr_ratio"),
        (["trainer.ema_decay=1.0"], "trainer.ema_decay"),
        (["data.val_fraction=-0.1"], "data.val_fraction"),
        (["parallel.timeout_s=0"], "parallel.timeout_s"),
        (["+model.overrides={time_min: nan}"], "model.overrides['time_min']"),
    ]
    assert _expect(cases) == []


def test_a_config_changed_after_construction_is_checked_again_by_validate() -> None:
    cfg = TrainConfig()
    cfg.optim.lr = float("nan")
    with pytest.raises(ValueError, match=r"optim\.lr must be a finite number, got nan"):
        validate(cfg, 1)
    cfg = TrainConfig()
    cfg.optim.betas = (0.9, float("inf"))
    with pytest.raises(ValueError, match=r"optim\.betas\[1\] must be a finite number, got inf"):
        validate(cfg, 1)
