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
import sys
import tempfile
import time
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vla.training.config import REQUIRED_RESOLVER, TrainConfig, required_value, to_train_config


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


CONFIG_GROUPS = frozenset(
    {"model", "optim", "data", "trainer", "parallel", "image_transforms", "experiment", "debug"}
)


def start_from_saved_config(cfg: Any, overrides: Iterable[str]) -> str | None:
    """A resume (`trainer.resume` set) into an output_dir holding a run's config.yaml starts from that
    configuration, with the command line's `key=value` overrides on top, so the original overrides need
    not be repeated (vla.training.resume then checks what changed). A command line that selects config
    groups (`optim=adamw`, `experiment=...`) composes afresh as before: what those groups set cannot be
    told apart from defaults. Returns the line to log when the saved configuration was used."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    resume = str(OmegaConf.select(cfg, "trainer.resume", default="none")).strip().lower()
    if resume in ("", "none", "null", "false"):
        return None
    saved_path = Path(str(cfg.output_dir)) / "config.yaml"
    if not saved_path.is_file():
        return None
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    if any(o.key_or_group in CONFIG_GROUPS or o.key_or_group.startswith("hydra") for o in parsed):
        return None
    saved = OmegaConf.load(saved_path)
    given = [o.key_or_group.lstrip("+~") for o in parsed if not o.is_delete()]
    with open_dict(saved):
        for key in given:
            OmegaConf.update(saved, key, OmegaConf.select(cfg, key), merge=False)
        saved.output_dir = str(cfg.output_dir)
    # A merge keeps the schema's types; dict-valued fields (camera maps, overrides) then take the saved
    # dict exactly, as a `key={...}` override would.
    merged = OmegaConf.merge(cfg, saved)
    with open_dict(merged):
        for path in dict_field_paths(TrainConfig):
            if OmegaConf.select(saved, path) is not None:
                OmegaConf.update(merged, path, OmegaConf.select(saved, path), merge=False)
    with open_dict(cfg):
        for key in saved:
            cfg[key] = merged[key]
    shown = ", ".join(k for k in given if k not in ("output_dir", "trainer.resume")) or "none"
    return f"resume: starting from {saved_path} (command-line changes: {shown})"


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


def remove_if_empty(path: str | Path | None, levels: int = 3) -> None:
    """Remove a directory Hydra created for this run if nothing was written into it, and then its
    parents that this left empty (Hydra's `outputs/<run name>/`, `outputs/`), at most `levels` of them
    and never the working directory."""
    if not path:
        return
    current = Path(path).absolute()
    cwd = Path.cwd().absolute()
    for _ in range(levels + 1):
        if current == cwd or cwd.is_relative_to(current):
            return
        try:
            current.rmdir()  # only succeeds on an empty directory
        except OSError:
            return
        current = current.parent


def hydra_output_dir() -> str | None:
    """Hydra's run (or sweep job) directory, when running under @hydra.main."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return str(HydraConfig.get().runtime.output_dir)


class LaunchError(RuntimeError):
    """The launcher started a different number of processes than it was asked for."""


def _parent_num_processes(pid: int | None = None) -> int | None:
    """`--num_processes N` / `--num-processes=N` on the parent's command line (Linux /proc), else None."""
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    words = raw.decode(errors="replace").split("\0")
    for i, word in enumerate(words):
        for flag in ("--num_processes", "--num-processes"):
            value = words[i + 1] if word == flag and i + 1 < len(words) else None
            if word.startswith(flag + "="):
                value = word.split("=", 1)[1]
            if value is not None and value.isdigit():
                return int(value)
    return None


def check_launch() -> None:
    """Refuse the silent single process of `accelerate launch --num_processes N` (N > 1) without
    `--multi_gpu` on a machine without several GPUs (Accelerate then runs the script once, world size 1)."""
    if "ACCELERATE_USE_CPU" not in os.environ or "WORLD_SIZE" in os.environ:
        return  # not accelerate's single-process launcher
    requested = _parent_num_processes()
    if requested and requested > 1:
        raise LaunchError(
            f"accelerate launch was asked for {requested} processes but started one (without --multi_gpu it "
            "runs a single process when it finds fewer than 2 GPUs); launch with `accelerate launch --multi_gpu "
            f"--num_processes {requested} train.py ...` (CPU or GPU) or `torchrun --standalone --nproc_per_node "
            f"{requested} train.py ...`"
        )


def _error_marker() -> Path | None:
    """A file the first failing rank of a multi-process run creates (torchrun / accelerate set the id)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not run_id:
        return None
    # The workers of one launch share their launcher (the parent process), its run id (only unique with
    # --standalone), its master port and the restart count.
    launch = "-".join(
        [
            run_id,
            str(os.getppid()),
            os.environ.get("MASTER_PORT", ""),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", ""),
        ]
    )
    return Path(tempfile.gettempdir()) / f"vla-run-{launch}.error"


ERROR_MARKER_GLOB = "vla-run-*.error"
STALE_MARKER_S = 600.0


def remove_stale_error_markers(launcher_pid: int | None = None) -> None:
    """Remove error markers of launches that ended: those of `launcher_pid` (vla.launch, once its workers
    exited), and any older than STALE_MARKER_S (a launch's ranks fail within its collective timeout of
    each other; plain torchrun leaves its marker to this)."""
    now = time.time()
    for path in Path(tempfile.gettempdir()).glob(ERROR_MARKER_GLOB):
        with contextlib.suppress(OSError):
            ours = launcher_pid is not None and f"-{launcher_pid}-" in path.name
            if ours or now - path.stat().st_mtime > STALE_MARKER_S:
                path.unlink()


def report_once(exc: BaseException) -> bool:
    """Under a multi-process launch, whether this rank reports `exc` (the first rank to fail does; ranks
    failing later with the same message stay quiet, with another one they print one line)."""
    marker = _error_marker()
    if marker is None:
        return True
    message = f"{type(exc).__name__}: {exc}"
    remove_stale_error_markers()
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        with contextlib.suppress(OSError):
            first = marker.read_text()
            if first and first != message:
                rank = os.environ.get("RANK", "?")
                print(
                    f"[rank {rank}] failed too: {message.splitlines()[0][:300]}", file=sys.stderr, flush=True
                )
        return False
    with os.fdopen(fd, "w") as f:
        f.write(message)
    print(f"[rank {os.environ.get('RANK', '?')}] failed:", file=sys.stderr, flush=True)
    return True


def main(cfg: Any) -> int:
    """The body of train.py's @hydra.main: one error report per run, no empty directories left behind.

    Returns the exit code (vla.training.guards): EXIT_FINISHED, or EXIT_STOPPED after SIGINT/SIGTERM;
    failures raise (exit 1).
    """
    from hydra.core.hydra_config import HydraConfig

    from vla.training.guards import EXIT_FINISHED, StopRequested, stop_behind

    hydra_dir = hydra_output_dir()
    try:
        check_launch()
        replace_dict_overrides(cfg, HydraConfig.get().overrides.task, TrainConfig)
        if note := start_from_saved_config(cfg, HydraConfig.get().overrides.task):
            print(note, flush=True)
        train_config = to_train_config(cfg)
        if hydra_dir and os.path.abspath(train_config.output_dir) != os.path.abspath(hydra_dir):
            remove_if_empty(hydra_dir)  # output_dir=... was given: Hydra's directory stays unused
        from vla.training.loop import run  # after the config checks: their errors need none of it

        summary = run(train_config)
    except StopRequested as stop:
        return _stopped(str(stop))
    except Exception as exc:
        from vla.training.user_errors import describe, is_user_error, traceback_requested

        if (stop := stop_behind(exc)) is not None:  # e.g. the workers died of the same SIGTERM
            return _stopped(str(stop))

        remove_if_empty(hydra_dir)  # a run that failed at start-up leaves no empty directory
        if not report_once(exc):
            raise SystemExit(1) from None  # another rank reported it (Hydra would print it again)
        if is_user_error(exc) and not traceback_requested():
            # The message names the key or file and the fix; a traceback (and Hydra's note) would bury it.
            print(describe(exc), file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise
    if summary.stopped_early:
        return _stopped(f"{summary.stopped_early}; resume with trainer.resume=auto (exit code 130)")
    return EXIT_FINISHED


def _stopped(message: str) -> int:
    """End a stopped run: one line on stderr, no SIGCHLD tracebacks from dead workers, exit 130."""
    from vla.training.guards import EXIT_STOPPED, quiet_worker_deaths

    quiet_worker_deaths()
    print(f"vla: {message}", file=sys.stderr, flush=True)
    return EXIT_STOPPED


def console_main() -> None:
    """The `vla-train` console script: train.py's @hydra.main with the repository's configs/, so it runs
    from any directory (outputs and generated data land under the working directory, as with train.py)."""
    import hydra

    from vla.training.guards import EXIT_FINISHED

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    register_configs()
    code = [EXIT_FINISHED]
    config_dir = str(Path(__file__).resolve().parents[2] / CONFIG_DIR)

    def body(cfg: Any) -> None:
        code[0] = main(cfg)

    hydra.main(version_base=None, config_path=config_dir, config_name="config")(body)()
    sys.exit(code[0])


__all__ = [
    "LaunchError",
    "check_launch",
    "compose",
    "compose_many",
    "console_main",
    "dict_field_paths",
    "main",
    "register_configs",
    "remove_if_empty",
    "replace_dict_overrides",
    "report_once",
    "resolve_run_dir",
    "schema_node",
    "start_from_saved_config",
]


# -- composing the schema (train.py, tests, scripts) -------------------------------------------
CONFIG_DIR = "configs"


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent); its dict-valued fields take new keys
    (see vla.training.cli)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="train_schema", node=schema_node(TrainConfig))
    OmegaConf.register_new_resolver(REQUIRED_RESOLVER, required_value, replace=True)


def compose(overrides: list[str] | None = None, config_dir: str | None = None) -> TrainConfig:
    """Compose configs/config.yaml with command-line style overrides (for tests and scripts)."""
    return compose_many([list(overrides or [])], config_dir)[0]


def compose_many(override_sets: list[list[str]], config_dir: str | None = None) -> list[TrainConfig]:
    """Several compositions under one Hydra initialisation (initialising costs more than composing)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    directory = Path(config_dir) if config_dir else Path(__file__).resolve().parents[2] / CONFIG_DIR
    GlobalHydra.instance().clear()
    configs = []
    with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
        for overrides in override_sets:
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
            resolve_run_dir(cfg)  # output_dir as a run of train.py would get it (no directory is made)
            replace_dict_overrides(cfg, overrides, TrainConfig)
            start_from_saved_config(cfg, overrides)
            configs.append(to_train_config(cfg))
    return configs
