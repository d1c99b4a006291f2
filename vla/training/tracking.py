"""Where metrics go: a rich progress bar, metrics.jsonl, TensorBoard, and wandb when configured.

Only rank 0 writes; other ranks get a disabled tracker with the same interface.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Tracker:
    """Writes one JSON object per logged step to `metrics.jsonl` (and the same scalars elsewhere).

    `step` is the number of optimizer steps done (1..N), as in the console and checkpoints/step_N.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        progress_bar: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "vla",
        wandb_mode: str | None = None,
        run_name: str = "run",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.console = Console(stderr=False, soft_wrap=True)
        self.metrics_path = output_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._wandb = None
        self._progress: Progress | None = None
        self._task = None
        if not enabled:
            return
        # metrics.jsonl, TensorBoard and wandb open at the first record, not here: a run refused while it
        # starts (a resume with other settings, an output_dir holding another run) leaves no trace.
        self._output_dir = output_dir
        self.purge_step: int | None = None  # set on resume: TensorBoard hides the events of re-run steps
        self._replay: list[dict[str, Any]] = []  # kept records written to TensorBoard again after a purge
        self._tb_dir = output_dir / "tb" if tensorboard else None
        self._wandb_init: dict[str, Any] | None = None
        if wandb:
            try:
                import wandb as wandb_module  # noqa: F401 (checked now, initialised at the first record)
            except ImportError as exc:
                raise ValueError(
                    "trainer.tracker=wandb needs `pip install wandb` (or the [wandb] extra), or "
                    "trainer.tracker=tensorboard"
                ) from exc
            self._wandb_init = {
                "project": wandb_project,
                "name": run_name,
                "config": config,
                "dir": str(output_dir),
                # One wandb run per run directory: a resume continues it instead of starting another.
                "id": wandb_run_id(output_dir),
                "resume": "allow",
                **({"mode": wandb_mode} if wandb_mode else {}),
            }
        if progress_bar and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float], *, prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": prefix, "time": time.time(), **metrics}
        self._open_writers()
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(f"{prefix}/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)
        if prefix == "train":
            status = "  ".join(f"{k} {metrics[k]:.4g}" for k in ("loss", "lr", "step_s") if k in metrics)
            if self._progress is not None:
                self._progress.update(self._task, completed=step, status=status)
            else:
                self.console.print(f"step {step}: {status}", highlight=False, markup=False)
        else:
            self.print(f"[{prefix}] step {step}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    def _open_writers(self) -> None:
        if self._file is None:
            self._output_dir.mkdir(parents=True, exist_ok=True)
            self._file = self.metrics_path.open("a", buffering=1)
        if self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self._tb_dir), purge_step=self.purge_step)
            self._tb_dir = None
            for record in self._replay:
                for key, value in record.items():
                    if key not in ("step", "split", "time") and isinstance(value, int | float):
                        self._tb.add_scalar(f"{record['split']}/{key}", value, record["step"])
            self._replay = []
        if self._wandb_init is not None:
            import wandb as wandb_module

            self._wandb = wandb_module.init(**self._wandb_init)
            self._wandb_init = None

    def replay_step(self, step: int) -> None:
        """Write metrics.jsonl's records of `step` to TensorBoard again once it opens (after a purge
        from `step` on hid them there)."""
        if not self.metrics_path.is_file():
            return
        for line in self.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step") == step and "split" in record:
                self._replay.append(record)

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()


def wandb_run_id(output_dir: Path) -> str:
    """The wandb run id of a run directory: stable across resumes (and processes), distinct across dirs."""
    import hashlib

    return hashlib.sha1(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]
