"""What train.py adds around Hydra: dict-valued overrides, Hydra's output directory, one error per run.

Dict-valued fields (`data.camera_map`, `data.norm_modes`, `model.overrides`) take a plain `key={...}` on the
command line, and it replaces the dict (Hydra would merge it into the preset's, and refuse new keys under
struct mode): the schema node of each such field is not in struct mode (`schema_node`), and
`replace_dict_overrides` assigns the command line's value after composing.

The output directory is Hydra's: `output_dir` defaults to `${hydra:runtime.output_dir}`, i.e. `hydra.run.dir`
for a run and `hydra.sweep.dir/hydra.sweep.subdir` for each job of a `-m` sweep; `output_dir=...` still
overrides it (the empty directory Hydra created is then removed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def dict_field_paths(schema: type, prefix: str = "") -> list[str]:
    """Dotted paths of every dict-valued field of a dataclass schema (nested dataclasses included)."""
    hints = typing.get_type_hints(schema)
    paths = []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        union = typing.get_origin(kind) in (typing.Union, types.UnionType)
        options = typing.get_args(kind) if union else (kind,)
        if any(typing.get_origin(o) is dict or o is dict for o in options):
            paths.append(prefix + f.name)
        elif dataclasses.is_dataclass(kind):
            paths.extend(dict_field_paths(kind, f"{prefix}{f.name}."))
    return paths


def schema_node(schema: type) -> Any:
    """The structured config of `schema` with its dict-valued fields out of struct mode (new keys allowed)."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(schema)
    for path in dict_field_paths(schema):
        parent, _, leaf = path.rpartition(".")
        container = OmegaConf.select(node, parent) if parent else node
        OmegaConf.set_struct(container._get_node(leaf), False)
    return node


def replace_dict_overrides(cfg: Any, overrides: Iterable[str], schema: type) -> None:
    """Give each `key={...}` (or `++key={...}`) override of a dict-valued field exactly that dict."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    paths = set(dict_field_paths(schema))
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    for override in parsed:
        key = override.key_or_group
        if key not in paths or override.is_delete() or override.is_add():
            continue
        value = override.value()
        if isinstance(value, dict):
            with open_dict(cfg):
                OmegaConf.update(cfg, key, value, merge=False)


def resolve_run_dir(cfg: Any) -> None:
    """For compose() outside @hydra.main: set hydra.runtime.output_dir as Hydra's run_job would (the
    absolute hydra.run.dir), resolve output_dir against it, and drop the `hydra` node."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = os.path.abspath(str(cfg.hydra.run.dir))
    HydraConfig.instance().set_config(cfg)
    output_dir = str(cfg.output_dir)
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.output_dir = output_dir


def remove_if_empty(path: str | Path | None) -> None:
    """Remove a directory Hydra created for this run if nothing was written into it."""
    if not path:
        return
    with contextlib.suppress(OSError):
        Path(path).rmdir()  # only succeeds on an empty directory


def hydra_output_dir() -> str | None:
    """Hydra's run (or sweep job) directory, when running under @hydra.main."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return str(HydraConfig.get().runtime.output_dir)


def main(cfg: Any) -> None:
    """The body of train.py's @hydra.main."""
    from hydra.core.hydra_config import HydraConfig

    from vla.training.config import TrainConfig, to_train_config
    from vla.training.loop import run

    replace_dict_overrides(cfg, HydraConfig.get().overrides.task, TrainConfig)
    train_config = to_train_config(cfg)
    hydra_dir = hydra_output_dir()
    if hydra_dir and os.path.abspath(train_config.output_dir) != os.path.abspath(hydra_dir):
        remove_if_empty(hydra_dir)  # output_dir=... was given: Hydra's directory stays unused
    run(train_config)


__all__ = [
    "dict_field_paths",
    "main",
    "remove_if_empty",
    "replace_dict_overrides",
    "resolve_run_dir",
    "schema_node",
]
