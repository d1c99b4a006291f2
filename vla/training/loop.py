"""The fit loop: one optimizer step = grad_accum micro-batches, clipping, the step, the schedule.

Per step it logs loss, lr, grad norm, samples/s and the time split into data, forward+backward and
optimizer step (with the optimizer's exposed communication where dmuon reports it). Non-finite
losses stop the run (or skip up to trainer.max_skipped_steps steps first) before anything is saved.
SIGINT / SIGTERM inside a step finish it, then save a checkpoint (trainer.save_on_interrupt) and
stop; outside a step, on a second signal or past trainer.stop_grace_s they stop at once
(vla.training.guards). NaN/inf validation or open-loop metrics stop the run with an error. fit()
holds output_dir's run lock (vla.training.runlock); resuming checks the config and dataset against
the checkpoint's (vla.training.resume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dmuon.layout import local_tensor
from vla.training.config import TrainConfig, validate
from vla.training.data import build_data
from vla.training.ema import EMA
from vla.training.guards import (
    StopSignals,
    check_finite_metrics,
    check_output_dir,
    outside_step,
    start_launcher_watchdog,
)
from vla.training.noise import flow_matching_inputs
from vla.training.optim import apply_schedule_at, build_optimizer, build_scheduler, effective_warmup
from vla.training.parallel import (
    is_sharded,
    launched_world_size,
    prepare,
    reshard,
    resolve_auto,
    setup_accelerator,
    shard_unit_classes,
    unwrap,
)
from vla.training.resume import check_resume, dataset_fingerprint, flatten, truncate_metrics
from vla.training.rundir import claim_run_directory_collective
from vla.training.runlock import acquire_run_lock
from vla.training.tracking import Tracker


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm."""


@dataclass
class StepTimes:
    data_s: float = 0.0
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0
    optimizer_comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.data_s + self.forward_backward_s + self.optimizer_s


@dataclass
class Summary:
    """What a run reports at the end (also written to output_dir/summary.json)."""

    output_dir: str
    steps: int
    final_loss: float | None
    val_loss: float | None
    median_step_s: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    export: str | None = None
    metrics: str | None = None
    tensorboard: str | None = None
    stopped_early: str | None = None
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)
    open_loop: dict[str, Any] | None = None
    closed_loop: dict[str, Any] | None = None
    skipped_steps: int = 0  # steps skipped under trainer.nan_policy=skip
    # trainer.compile: the first step's time beyond the median step (compiling, mostly); None without compile
    compile_s: float | None = None
    # This rank's peak memory: CUDA memory allocated by torch on a GPU, the process's peak RSS on CPU
    peak_memory_gib: float | None = None
    status: str = "finished"  # or "stopped" (SIGINT/SIGTERM; train.py exits 130)


def _all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True if any rank says True (so every rank takes the same branch)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor.tolist()


def _shared_output_dir(path: str, device: torch.device) -> Path:
    """Rank 0's output directory, for every rank (their `${now:}` may differ by a second); a rank whose
    own choice differs removes the empty directory Hydra made for it."""
    from vla.training.cli import remove_if_empty

    box = [path]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if os.path.abspath(path) != os.path.abspath(box[0]):
        remove_if_empty(path)
    return Path(box[0])


def _batch_frames(batches: list[Any], shown: int = 8) -> str:
    """'episode 3 frame 17, ...' for the frames of a step's micro-batches (as the data meta has them)."""
    pairs: list[tuple[int, int]] = []
    for batch in batches:
        meta = getattr(batch, "meta", None) or {}
        episodes, frames = meta.get("episode_index"), meta.get("frame_index")
        if episodes is None or frames is None:
            continue
        pairs += list(zip(torch.as_tensor(episodes).tolist(), torch.as_tensor(frames).tolist(), strict=True))
    if not pairs:
        return "frames this dataset does not index"
    text = ", ".join(f"episode {e} frame {f}" for e, f in pairs[:shown])
    return text + (f" and {len(pairs) - shown} more" if len(pairs) > shown else "")


def _crash_for_tests(step: int, rank: int) -> None:
    """Fault injection for the failure tests: VLA_TEST_CRASH_AT_STEP=<step> [VLA_TEST_CRASH_RANK=<rank>]."""
    at = os.environ.get("VLA_TEST_CRASH_AT_STEP")
    if at is not None and int(at) == step and int(os.environ.get("VLA_TEST_CRASH_RANK", rank)) == rank:
        os._exit(17)  # a hard crash: no cleanup, no collective goodbye


def _exit_for_tests(step: int) -> None:
    """Resume tests: VLA_TEST_EXIT_AFTER_STEP=<step> ends the run right after that step's checkpoint."""
    at = os.environ.get("VLA_TEST_EXIT_AFTER_STEP")
    if at is not None and int(at) == step:
        raise SystemExit(f"VLA_TEST_EXIT_AFTER_STEP={at}")


class Trainer:
    """Builds everything from a TrainConfig and runs `fit()`."""

    def __init__(self, cfg: TrainConfig) -> None:
        from vla.models import build_policy
        from vla.training.checkpoint import CheckpointManager

        self.cfg = cfg
        trainer = cfg.trainer
        # Cheap checks first (metadata, memory): a run that cannot work fails before the model is built.
        from vla.models.factory import resolve_config
        from vla.training.closed_loop import check_closed_loop_seeds
        from vla.training.data import check_tokenizer, resolve_hub_dataset, resolve_weights
        from vla.training.preflight import check_dataset_before_model, check_memory

        resolve_hub_dataset(cfg.data)  # hub ids: from the cache (or fetched) before anything is built
        weights = resolve_weights(cfg.model)
        policy_config = resolve_config(cfg.model.preset, **cfg.model.policy_overrides())
        check_dataset_before_model(cfg, policy_config)
        launched = launched_world_size()
        planned, _ = resolve_auto(cfg.parallel, launched, None)
        self._memory_note = (
            check_memory(
                dataclasses.replace(cfg, parallel=planned),
                policy_config,
                launched,
                "cuda" if torch.cuda.is_available() else "cpu",
            )
            if trainer.check_memory
            else None
        )
        # After the memory check (a run too big for the device is refused whatever its tokenizer), before
        # the model: PaliGemma's tokenizer may need the Hugging Face cache.
        check_tokenizer(cfg.data, policy_config)
        torch.manual_seed(trainer.seed)  # identical initial weights on every rank
        policy = build_policy(policy_config)
        self._weights_note = None
        if weights:
            report = _load_weights(policy, weights, cfg.model.weights_format)
            self._weights_note = (
                f"model.weights: {len(report.loaded)} tensors loaded from {weights}"
                + (f" ({cfg.model.weights})" if weights != cfg.model.weights else "")
                + f", {len(report.left_initialised)} left initialised, {len(report.ignored)} ignored"
            )
        cfg.parallel, self._parallel_note = resolve_auto(cfg.parallel, launched, policy)
        self.accelerator = setup_accelerator(cfg.parallel, trainer.precision, shard_unit_classes(policy))
        acc = self.accelerator
        self.rank, self.world = acc.process_index, acc.num_processes
        self.device = acc.device
        validate(cfg, self.world)
        self.output_dir = _shared_output_dir(cfg.output_dir, self.device)
        check_output_dir(self.output_dir)
        self.is_main = acc.is_main_process
        self.micro_batch = trainer.batch_size // (self.world * trainer.grad_accum)
        self.data = build_data(
            cfg.data,
            policy.config,
            micro_batch=self.micro_batch,
            seed=trainer.seed,
            rank=self.rank,
            world=self.world,
            device=self.device,
        )
        _set_action_dim_from_data(policy, self.data.processor.action_dim)
        # the dataset exists now (recorded if it had to be): its seeds against every evaluation's, before step 1
        check_closed_loop_seeds(cfg)
        optimizer = build_optimizer(cfg.optim, policy)
        self.routing = _describe_routing(optimizer)
        self._compile_note = None
        if trainer.compile:
            from vla.training.parallel import compile_units

            compiled = compile_units(policy, trainer.compile_mode)
            self._compile_note = (
                f"trainer.compile: {compiled} blocks compiled (mode {trainer.compile_mode or 'default'}); the "
                "first step (and the first validation, evaluation and sampling calls) include compiling: "
                "compile_s in the summary"
            )
        self.model, self.optimizer = prepare(acc, policy, optimizer)
        self.scheduler = build_scheduler(self.optimizer, trainer)
        self.ema = EMA(self.model, trainer.ema_decay) if trainer.ema_decay else None
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep_last=trainer.keep_last)
        self.tracker = Tracker(
            self.output_dir,
            enabled=self.is_main,
            total_steps=trainer.steps,
            progress_bar=trainer.progress_bar,
            tensorboard="tensorboard" in trainer.tracker,
            wandb="wandb" in trainer.tracker,
            wandb_project=trainer.wandb_project,
            wandb_mode=trainer.wandb_mode,
            run_name=cfg.run_name,
            config=asdict(cfg),
        )
        self.step = 0
        self.skipped = 0
        self.resumed_losses: tuple[float | None, float | None] = (
            None,
            None,
        )  # (train, val) at the resumed step
        self.last_losses: tuple[float | None, float | None] = (None, None)  # saved with each checkpoint
        self.train_seconds = 0.0  # data + forward/backward + optimizer, summed over the steps (resumed too)
        self.stop_signals: StopSignals | None = None
        self._dataset_fingerprint = dataset_fingerprint(self.data.meta.root)

    # ------------------------------------------------------------------ persistence
    def _write_run_files(self) -> None:
        if not self.is_main:
            return
        from omegaconf import OmegaConf

        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(self.cfg)))
        (self.output_dir / "processor.json").write_text(
            json.dumps(self.data.processor.state_dict(), indent=1)
        )

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped": self.skipped,
            "train_seconds": self.train_seconds,
            "loader": self.data.train.state_dict(),
            "global_batch": self.cfg.trainer.batch_size,
            "config": flatten(self.cfg),  # compared on resume (vla.training.resume)
            "dataset": self._dataset_fingerprint,
            "last_loss": self.last_losses[0],
            "val_loss": self.last_losses[1],
        }

    def save_checkpoint(self) -> Path:
        extra = {"ema": self.ema.state_dict()} if self.ema else None
        return self.checkpoints.save(
            self.step,
            unwrap(self.model),
            _inner(self.optimizer),
            scheduler=self.scheduler,
            trainer_state=self._trainer_state(),
            extra_state=extra,
        )

    def maybe_resume(self) -> Path | None:
        path = self.checkpoints.resolve(self.cfg.trainer.resume)
        if path is None:
            # resume=auto without a checkpoint (a run stopped before its first one) starts over: the
            # records of its earlier attempt go, so every step is recorded once.
            if self.is_main and (dropped := truncate_metrics(self.tracker.metrics_path, 0)):
                self.tracker.print(
                    f"metrics.jsonl: dropped {dropped} record(s) of an attempt with no checkpoint"
                )
            self.tracker.purge_step = 1
            return None
        extra = {"ema": self.ema.state_dict()} if self.ema else None
        for skipped, reason in self.checkpoints.skipped:
            self.tracker.print(f"resume=auto skipped {skipped.name}: {reason}")
        # The saved config is compared before the checkpoint is loaded: a changed model would otherwise
        # surface as DCP's size-mismatch error instead of the list of changed keys.
        saved_state = self.checkpoints.read_trainer_state(path)
        for note in check_resume(self.cfg, saved_state, path, self.output_dir, self.data.meta.root):
            self.tracker.print(note)
        state = self.checkpoints.load(
            path, unwrap(self.model), _inner(self.optimizer), scheduler=self.scheduler, extra_state=extra
        )
        self.step = int(state["step"])
        apply_schedule_at(self.scheduler)
        # At the last step only the final evaluations re-run: their records of that step go too, and the
        # step's training / validation losses come back from the checkpoint for the summary.
        final = self.step == self.cfg.trainer.steps
        self.resumed_losses = (state.get("last_loss"), state.get("val_loss"))
        rerun = ("eval",) if final else ()
        if self.is_main and (dropped := truncate_metrics(self.tracker.metrics_path, self.step, rerun)):
            what = f"steps after {self.step}" + (f" and the evaluations of step {self.step}" if final else "")
            self.tracker.print(f"metrics.jsonl: dropped {dropped} record(s) of {what} (re-run now)")
        # TensorBoard hides what the earlier attempt logged from the first re-run step on; at the last
        # step that is the step itself, so its kept records are written again.
        self.tracker.purge_step = self.step if final else self.step + 1
        if final and self.is_main:
            self.tracker.replay_step(self.step)
        self.skipped = int(state.get("skipped", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        loader_state = dict(state["loader"])
        if loader_state.get("world_size") != self.world or loader_state.get("batch_size") != self.micro_batch:
            # Same global batch on another world size or grad_accum: one permutation is dealt round-robin,
            # so the samples consumed so far (micro-batches x micro-batch x ranks) carry over; only the
            # micro-batch count of the epoch is rescaled.
            if state.get("global_batch") != self.cfg.trainer.batch_size:
                raise ValueError(
                    f"checkpoint {path} was trained with global batch {state.get('global_batch')}; resuming "
                    f"with trainer.batch_size={self.cfg.trainer.batch_size} would change the trajectory"
                )
            consumed = (
                int(loader_state["batches_in_epoch"])
                * int(loader_state["batch_size"])
                * int(loader_state["world_size"])
            )
            per_micro_step = self.micro_batch * self.world
            if consumed % per_micro_step:
                raise ValueError(
                    f"checkpoint {path} stopped {consumed} samples into its epoch, not a whole number of "
                    f"micro-batches of {self.micro_batch} x {self.world} ranks (trainer.grad_accum="
                    f"{self.cfg.trainer.grad_accum}); resume with the checkpoint's trainer.grad_accum and "
                    "world size, or from another checkpoint"
                )
            loader_state.update(
                world_size=self.world,
                batch_size=self.micro_batch,
                batches_in_epoch=consumed // per_micro_step,
            )
        self.data.train.load_state_dict(loader_state)
        self.tracker.print(f"resumed from {path} at step {self.step}")
        return path

    # ------------------------------------------------------------------ steps
    def _loss_inputs(self, batch: Any, stream: str) -> dict[str, Any]:
        """Per-sample noise and flow times for pi0 (see vla.training.noise); nothing for other policies."""
        config = unwrap(self.model).config
        if config.kind != "pi0":
            return {}
        noise, time = flow_matching_inputs(
            batch,
            seed=self.cfg.trainer.seed,
            step=self.step if stream == "train" else 0,
            stream=stream,
            alpha=config.time_beta_alpha,
            beta=config.time_beta_beta,
            time_min=config.time_min,
        )
        return {"noise": noise, "time": time}

    def _forward_backward(self, batches: list[Any]) -> tuple[float, dict[str, float]]:
        model, acc = self.model, self.accelerator
        accum = len(batches)
        total = 0.0
        metric_sums: dict[str, float] = {}
        for i, batch in enumerate(batches):
            sync = i == accum - 1
            context = contextlib.nullcontext() if sync or self.world == 1 else acc.no_sync(model)
            inputs = self._loss_inputs(batch, "train")
            with context, acc.autocast():
                loss, metrics = model(batch, **inputs)
                acc.backward(loss / accum)
            total += float(loss.detach()) / accum
            for key, value in metrics.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + float(value) / accum
        return total, metric_sums

    def _clip(self) -> float:
        max_norm = self.cfg.trainer.clip_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        else:
            norm = self.accelerator.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    @outside_step("validation")
    @torch.no_grad()
    def validate(self) -> float | None:
        loader = self.data.val
        if loader is None or self.cfg.trainer.val_batches == 0:
            return None
        self.model.eval()
        loader.epoch, loader.batches_in_epoch = 0, 0  # the same held-out batches every time
        losses = []
        ema = self.ema.applied(self.model) if self.ema else contextlib.nullcontext()
        with ema:
            for batch, _ in zip(loader, range(self.cfg.trainer.val_batches)):
                inputs = self._loss_inputs(batch, "val")  # the same noise every validation
                with self.accelerator.autocast():
                    loss, _ = self.model(batch, **inputs)
                losses.append(float(loss))
        reshard(self.model)
        self.model.train()
        return _mean_over_ranks([statistics.fmean(losses)], self.device)[0] if losses else None

    @outside_step("the open-loop evaluation")
    @torch.no_grad()
    def evaluate_open_loop(self) -> dict[str, Any] | None:
        """Sampled chunks vs recorded actions on held-out episodes, in dataset units (vla.eval)."""
        from vla.eval.open_loop import open_loop_sums, report_from_sums

        loader = self.data.val
        if loader is None or self.cfg.trainer.val_batches == 0:
            return None
        self.model.eval()
        loader.epoch, loader.batches_in_epoch = 0, 0
        # FSDP2 gathers parameters around the registered sample_actions; DDP needs no wrapper here.
        policy_sample = (
            self.model.sample_actions if is_sharded(self.model) else unwrap(self.model).sample_actions
        )

        def sample(batch: Any) -> torch.Tensor:
            # Per-sample noise (as in training), so the result does not depend on the world size.
            noise = self._loss_inputs(batch, "eval").get("noise")
            return policy_sample(batch.observation, noise=noise)

        ema = self.ema.applied(self.model) if self.ema else contextlib.nullcontext()
        with ema, self.accelerator.autocast():
            sums = open_loop_sums(
                sample,
                loader,
                self.data.processor.unnormalize_actions,
                max_batches=self.cfg.trainer.val_batches,
            )
        reshard(self.model)
        self.model.train()
        if dist.is_available() and dist.is_initialized():
            for value in sums.values():
                dist.all_reduce(value)  # sums over every rank's held-out samples
        return asdict(report_from_sums(sums))

    @outside_step("the closed-loop evaluation")
    @torch.no_grad()
    def evaluate_closed_loop(self, *, final: bool) -> dict[str, Any] | None:
        """MetaWorld success per task (trainer.closed_loop), logged as eval/success/<task>; see
        vla.training.closed_loop. The final evaluation also writes closed_loop.json and its videos."""
        from vla.training.closed_loop import closed_loop_evaluation

        if self.cfg.data.source != "metaworld" or self.cfg.trainer.closed_loop.episodes == 0:
            return None
        start = time.perf_counter()
        video_dir = self.output_dir / "videos" if final else None
        settings = self.cfg.trainer.closed_loop
        episodes = settings.final_episodes if final and settings.final_episodes else settings.episodes
        ema = self.ema.applied(self.model) if self.ema else contextlib.nullcontext()
        with ema:
            report = closed_loop_evaluation(
                self.cfg, self.model, self.data.processor, is_sharded(self.model), video_dir, episodes
            )
        reshard(self.model)
        if report is None:
            return None
        scalars = report.pop("scalars")
        # the x axes of a success curve: steps (the record's) and training seconds so far
        scalars |= {"train_s": self.train_seconds, "episodes": float(episodes)}
        self.tracker.log(self.step, scalars, prefix="eval")
        if self.is_main:
            if final:
                (self.output_dir / "closed_loop.json").write_text(json.dumps(report, indent=1))
            rates = ", ".join(f"{t['task']} {t['success_rate']:.0%}" for t in report["tasks"])
            self.tracker.print(
                f"closed loop at step {self.step}: mean success {report['mean_success']:.0%} ({rates}) "
                f"in {time.perf_counter() - start:.0f} s"
            )
        return report

    def fit(self) -> Summary:
        """Train; holds output_dir's run lock and the stop-signal handlers until it returns or raises."""
        with StopSignals(self.cfg.trainer.stop_grace_s) as self.stop_signals:
            lock = acquire_run_lock(self.output_dir, is_main=self.is_main)
            try:
                moved = claim_run_directory_collective(
                    self.output_dir,
                    resume=self.cfg.trainer.resume,
                    overwrite=self.cfg.trainer.overwrite,
                    is_main=self.is_main,
                )
                if moved:
                    self.tracker.print(moved)
                return self._fit()
            finally:
                if lock is not None:
                    lock.release()

    def _fit(self) -> Summary:
        cfg = self.cfg.trainer
        self.tracker.print(
            f"run {self.cfg.run_name}: {self.cfg.model.preset} with {self.cfg.optim.name} on {self.world} "
            f"process(es) ({self.cfg.parallel.mode}), global batch {cfg.batch_size}, output {self.output_dir}"
        )
        if self._parallel_note:
            self.tracker.print(self._parallel_note)
        if self._memory_note:
            self.tracker.print(self._memory_note)
        if self._weights_note:
            self.tracker.print(self._weights_note)
        if self._compile_note:
            self.tracker.print(self._compile_note)
        self.tracker.print(self.routing)
        for note in self.data.notes:
            self.tracker.print(note)
        _, warmup_note = effective_warmup(cfg)
        if warmup_note:
            self.tracker.print(warmup_note)
        self.maybe_resume()
        self._write_run_files()  # after the resume checks: a refused resume leaves config.yaml as it was
        iterator = self.data.train.forever()
        history: list[StepTimes] = []
        last_loss, val_loss = self.resumed_losses
        stopped: str | None = None
        self.model.train()
        with self.stop_signals.training_steps() as stop:
            while self.step < cfg.steps:
                _crash_for_tests(self.step, self.rank)
                times = StepTimes()
                start = time.perf_counter()
                batches = [next(iterator) for _ in range(cfg.grad_accum)]
                times.data_s = time.perf_counter() - start

                start = time.perf_counter()
                loss, metrics = self._forward_backward(batches)
                grad_norm = self._clip()
                times.forward_backward_s = time.perf_counter() - start

                finite = math.isfinite(loss) and math.isfinite(grad_norm)
                if _all_ranks_agree(not finite, self.device) and not self._handle_non_finite(
                    loss, grad_norm, batches
                ):
                    continue
                start = time.perf_counter()
                rates = _learning_rates(self.optimizer)  # the lr this step uses
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.ema is not None:
                    self.ema.update(self.model, self.step)
                times.optimizer_s = time.perf_counter() - start
                times.optimizer_comm_s = getattr(_inner(self.optimizer), "last_step_stats", {}).get(
                    "comm_wait_s", 0.0
                )
                history.append(times)
                self.train_seconds += times.total_s

                self.step += 1
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    loss_mean, norm_mean, *metric_means = _mean_over_ranks(
                        [loss, grad_norm, *metrics.values()], self.device
                    )
                    last_loss = loss_mean
                    record = {
                        "loss": loss_mean,
                        "grad_norm": norm_mean,
                        **rates,
                        "samples_per_s": cfg.batch_size / times.total_s,
                        "step_s": times.total_s,
                        "data_s": times.data_s,
                        "forward_backward_s": times.forward_backward_s,
                        "optimizer_s": times.optimizer_s,
                        "optimizer_comm_s": times.optimizer_comm_s,
                    }
                    record.update({k: v for k, v in zip(metrics, metric_means) if k != "loss"})
                    self.tracker.log(self.step, record)
                if self.step % cfg.val_every == 0 or self.step == cfg.steps:
                    val_loss = self.validate()
                    if val_loss is not None:
                        self.tracker.log(self.step, {"loss": val_loss}, prefix="val")
                every = cfg.closed_loop.every
                if every and self.step % every == 0 and self.step != cfg.steps:
                    self.evaluate_closed_loop(final=False)
                self.last_losses = (last_loss, val_loss)
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    path = self.save_checkpoint()
                    self.tracker.print(f"checkpoint {path}")
                    _exit_for_tests(self.step)
                self._stop_on_non_finite_validation(val_loss)
                if _all_ranks_agree(stop.requested, self.device):
                    stop.at_boundary()
                    stopped = f"interrupted at step {self.step}"
                    if cfg.save_on_interrupt and self.step % cfg.checkpoint_every != 0:
                        path = self.save_checkpoint()
                        self.tracker.print(f"interrupted: saved {path}")
                    break
        open_loop = None
        if cfg.open_loop_eval and stopped is None:
            open_loop = self.evaluate_open_loop()
            if open_loop is not None:
                scalars = {k: v for k, v in open_loop.items() if not isinstance(v, list)}
                self.tracker.log(self.step, scalars, prefix="eval")
                check_finite_metrics(
                    {f"open-loop {k}": v for k, v in scalars.items()},
                    step=self.step,
                    hint="Sampled or recorded actions of the validation episodes are not finite: check those "
                    "episodes (data.val_fraction split of data.root) for NaN/inf state or action, or set "
                    "trainer.open_loop_eval=false. No policy was exported; the checkpoint of the last step "
                    "holds finite weights",
                )
        export = None
        if cfg.export_safetensors and stopped is None:
            from vla.training.export import export_policy, lerobot_unsupported, run_lerobot_config

            policy_config = unwrap(self.model).config
            ema = self.ema.applied(self.model) if self.ema else contextlib.nullcontext()
            with ema:
                export = export_policy(
                    self.model,
                    self.output_dir,
                    rank=self.rank,
                    lerobot_config=run_lerobot_config(policy_config, self.data, cfg.closed_loop.replan_every),
                )
            if policy_config.kind == "pi0":
                self._write_lerobot_processor(policy_config)
            if policy_config.kind == "pi0" and lerobot_unsupported(policy_config):
                self.tracker.print(
                    "export: LeRobot-named weights and LeRobot's processor files, but no "
                    "pretrained_model/config.json (LeRobot cannot build this size: "
                    f"{lerobot_unsupported(policy_config)})"
                )
        # After the export, so a failing simulator never costs the trained policy.
        closed_loop = self.evaluate_closed_loop(final=True) if stopped is None else None
        summary = self._summary(history, last_loss, val_loss, export, stopped, open_loop, closed_loop)
        self.tracker.close()
        return summary

    def _write_lerobot_processor(self, policy_config: Any) -> None:
        """LeRobot's processor files in pretrained_model/ (rank 0; every rank learns of a failure)."""
        from vla.training.checkpoint import _agree, _capture, _first
        from vla.training.export import LEROBOT_DIR, write_lerobot_processor_for

        failed: list[BaseException] = []
        if self.is_main:
            with _capture(failed):
                write_lerobot_processor_for(
                    self.output_dir / LEROBOT_DIR,
                    policy_config,
                    self.data.processor,
                    self.data.meta.features,
                    self.data.meta.stats,
                )
        _agree(_first(failed), f"writing LeRobot's processor files into {self.output_dir / LEROBOT_DIR}")

    def _stop_on_non_finite_validation(self, val_loss: float | None) -> None:
        """A NaN/inf validation loss ends the run with an error, after saving this step's (finite) weights."""
        if val_loss is None or math.isfinite(val_loss):
            return
        cfg = self.cfg.trainer
        if self.step % cfg.checkpoint_every != 0 and self.step != cfg.steps:
            self.save_checkpoint()
        check_finite_metrics(
            {"validation loss": val_loss},
            step=self.step,
            hint="The training loss is finite, so the validation episodes (the data.val_fraction split of "
            "data.root) probably hold NaN/inf state or action: fix them, or set trainer.val_batches=0 "
            f"to train without validation. The weights of step {self.step} are finite and saved: resume "
            "with trainer.resume=auto",
        )

    def _handle_non_finite(self, loss: float, grad_norm: float, batches: list[Any]) -> bool:
        """Skip this step (True: keep training) or raise, naming the step, the metric and this rank's
        (episode, frame) pairs of the batch."""
        culprit = "loss" if not math.isfinite(loss) else "grad_norm"
        value = loss if culprit == "loss" else grad_norm
        frames = _batch_frames(batches)
        self.optimizer.zero_grad(set_to_none=True)
        if self.cfg.trainer.nan_policy == "skip" and self.skipped < self.cfg.trainer.max_skipped_steps:
            self.skipped += 1
            self.tracker.print(
                f"step {self.step + 1}: {culprit} is {value} on some rank; skipped "
                f"({self.skipped}/{self.cfg.trainer.max_skipped_steps})"
            )
            self.step += 1
            return False
        raise NonFiniteLossError(
            f"step {self.step + 1}: {culprit} is {value} (on at least one rank); stopping before the optimizer "
            f"step so no checkpoint holds it. Rank {self.rank}'s batch held {frames} of {self.data.meta.root}. "
            "Lower optim.lr, check those frames, or set trainer.nan_policy=skip with "
            "trainer.max_skipped_steps > 0"
        )

    def _summary(
        self,
        history: list[StepTimes],
        last_loss: float | None,
        val_loss: float | None,
        export: Path | None,
        stopped: str | None,
        open_loop: dict[str, Any] | None,
        closed_loop: dict[str, Any] | None = None,
    ) -> Summary:
        steady = history[1:] if len(history) > 1 else history  # the first step builds state and plans
        medians = {}
        if steady:
            for key in ("data_s", "forward_backward_s", "optimizer_s", "optimizer_comm_s", "total_s"):
                medians[key] = statistics.median(getattr(t, key) for t in steady)
        compile_s = None
        if self.cfg.trainer.compile and history and medians:
            compile_s = max(0.0, history[0].total_s - medians["total_s"])
        latest = self.checkpoints.latest()
        summary = Summary(
            output_dir=str(self.output_dir),
            steps=self.step,
            final_loss=last_loss,
            val_loss=val_loss,
            median_step_s=medians,
            checkpoint=str(latest) if latest else None,
            export=str(export) if export else None,
            metrics=str(self.tracker.metrics_path),
            tensorboard=str(self.output_dir / "tb") if "tensorboard" in self.cfg.trainer.tracker else None,
            stopped_early=stopped,
            world_size=self.world,
            layout=parameter_layout(self.model),
            open_loop=open_loop,
            closed_loop=closed_loop,
            skipped_steps=self.skipped,
            status="stopped" if stopped else "finished",
            compile_s=compile_s,
            peak_memory_gib=_peak_memory_gib(self.device),
        )
        if self.is_main:
            (self.output_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1))
            self.tracker.print(format_summary(summary))
        return summary


def parameter_layout(model: torch.nn.Module) -> dict[str, Any]:
    """How this rank holds the parameters: DTensor count, placements, and bytes held locally."""
    placements: set[str] = set()
    dtensors = 0
    local_bytes = 0
    for p in model.parameters():
        local = local_tensor(p)
        local_bytes += local.numel() * local.element_size()
        if hasattr(p, "placements"):
            dtensors += 1
            placements.add(str(tuple(p.placements)))
    return {"dtensor_params": dtensors, "placements": sorted(placements), "local_param_bytes": local_bytes}


def _peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory of this rank so far: torch's CUDA allocations on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except (ImportError, OSError):
        return None


def format_summary(summary: Summary) -> str:
    m = summary.median_step_s
    lines = [
        "",
        f"done: {summary.steps} steps"
        + (f" ({summary.stopped_early})" if summary.stopped_early else "")
        + (f", {summary.skipped_steps} skipped (non-finite)" if summary.skipped_steps else ""),
        f"  final train loss  {summary.final_loss:.4f}"
        if summary.final_loss is not None
        else "  final train loss  -",
        f"  validation loss   {summary.val_loss:.4f}"
        if summary.val_loss is not None
        else "  validation loss   -",
    ]
    if m:
        lines.append(
            f"  step time (median) {m['total_s']:.3f}s = data {m['data_s']:.3f} + forward/backward "
            f"{m['forward_backward_s']:.3f} + optimizer {m['optimizer_s']:.3f} (exposed comm {m['optimizer_comm_s']:.3f})"
        )
    if summary.compile_s is not None:
        lines.append(
            f"  compile           {summary.compile_s:.1f}s (the first step beyond the median; trainer.compile)"
        )
    if summary.open_loop:
        o = summary.open_loop
        lines.append(
            f"  open-loop action MSE {o['mse']:.4g} on {o['samples']} held-out samples "
            f"(zero action {o['baseline_zero_mse']:.4g}, dataset mean {o['baseline_center_mse']:.4g})"
        )
    if summary.closed_loop:
        c = summary.closed_loop
        lines.append(
            f"  closed-loop success {c['mean_success']:.0%} mean over {len(c['tasks'])} MetaWorld task(s): "
            + ", ".join(f"{t['task']} {t['successes']}/{t['episodes']}" for t in c["tasks"])
        )
    lines += [
        f"  checkpoint        {summary.checkpoint}",
        f"  policy export     {summary.export}",
        f"  metrics           {summary.metrics}",
        f"  tensorboard       {summary.tensorboard}",
    ]
    return "\n".join(lines)


def _learning_rates(optimizer: Any) -> dict[str, float]:
    """lr of the first Muon group (or the only AdamW) and, for Muon, the AdamW side's as adamw_lr."""
    groups = _inner(optimizer).param_groups
    muon = [g["lr"] for g in groups if g.get("algorithm") == "muon"]
    adamw = [g["lr"] for g in groups if g.get("algorithm", "adamw") == "adamw"]
    rates = {"lr": muon[0] if muon else adamw[0]}
    if muon and adamw:
        rates["adamw_lr"] = adamw[0]
    return rates


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer under Accelerate's AcceleratedOptimizer wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _describe_routing(optimizer: torch.optim.Optimizer) -> str:
    import dmuon

    if isinstance(optimizer, dmuon.Muon):
        return "optimizer routing (dmuon.param_groups):\n" + dmuon.describe_param_groups(
            optimizer.param_groups
        )
    count = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    return f"optimizer: {type(optimizer).__name__} on {count:,} parameters"


def _load_weights(policy: torch.nn.Module, path: str, fmt: str) -> Any:
    from safetensors import SafetensorError

    from vla.eval.exported import DamagedExportError, check_export_bytes
    from vla.models.weights import load_weights

    if not Path(path).exists():
        raise FileNotFoundError(
            f"model.weights={path!r} does not exist; give a local .safetensors file or directory, or a hub id "
            "(org/name, through the Hugging Face cache)"
        )
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    for file in files:
        check_export_bytes(file)
    try:
        return load_weights(policy, path, fmt)
    except SafetensorError as exc:
        raise DamagedExportError(
            f"model.weights={path!r}: a safetensors file there cannot be read ({exc}): truncated or damaged. "
            "Copy or export it again"
        ) from exc


def _set_action_dim_from_data(policy: torch.nn.Module, action_dim: int) -> None:
    """OpenVLA-style presets leave action_dim unset: take the dataset's, so sampling without a Batch
    (evaluation, the export, closed loop) knows how many dims to decode."""
    config = policy.config
    if getattr(config, "kind", None) == "openvla" and config.action_dim is None:
        policy.config = config.replace(action_dim=action_dim)


def run(cfg: TrainConfig) -> Summary:
    """Build and fit (the body of train.py); the process group is torn down however the run ends.

    Under torchrun a watchdog ends the worker if the launcher dies; SIGINT/SIGTERM while building
    stop at once (guards.StopRequested, exit code 130 in train.py).
    """
    start_launcher_watchdog()
    try:
        with StopSignals(cfg.trainer.stop_grace_s):
            return Trainer(cfg).fit()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
