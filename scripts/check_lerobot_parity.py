"""Check a pi0 run against the real LeRobot 0.4.x: its processor files, and its weights where LeRobot can
build the size, from raw dataset frames to un-normalised actions.

Two steps in two interpreters (LeRobot 0.4 needs transformers 4, this project transformers 5):

    # 1. here: dataset frames, flow-matching noise and our policy runner's actions on them
    python scripts/check_lerobot_parity.py ours --run RUN_DIR --out parity/      # a trained pi0 run
    python scripts/check_lerobot_parity.py ours --full-size --out parity/       # a full-size pi0 (random
                                                                                # weights) exported first
    # 2. in a venv with lerobot 0.4.4 (docs/lerobot_parity.md says how one is built): LeRobot's own path
    /path/to/lerobot-venv/bin/python scripts/check_lerobot_parity.py lerobot --out parity/

Step 2 loads `pretrained_model/` with LeRobot's `make_pre_post_processors(cfg, pretrained_path=...)` and,
when it holds config.json + model.safetensors, `PI0Policy.from_pretrained` (strict); reads the same frames
with LeRobot's `LeRobotDataset` and compares, per frame: the items (images, state, task), the preprocessor's
output against our processor's (normalised state, prompt ids and mask), and LeRobot's action chunk
(`predict_action_chunk` with our noise, through its postprocessor) and `select_action`'s first action
against our runner's (`vla.eval.policy_runner.PolicyActor`). It prints a table, writes `report.json` into
--out and exits 1 when a difference exceeds its tolerance. Step 2 imports torch, safetensors and lerobot
only; nothing of this project.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # vla.help_format is plain argparse: step 2 imports it beside LeRobot too

from vla.help_format import HelpFormatter  # noqa: E402

PARITY_FILE = "parity.safetensors"
MANIFEST = "parity.json"
REPORT = "report.json"
# Tolerances (absolute): actions in dataset units; the normalised state; pixels in [0, 1].
ACTION_ATOL = 1e-5
STATE_ATOL = 1e-6
PIXEL_ATOL = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "side",
        choices=("ours", "lerobot"),
        help="ours: step 1 (this venv); lerobot: step 2 (a LeRobot 0.4.x venv)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="step 1 writes here, step 2 reads and reports here"
    )
    parser.add_argument(
        "--run", type=Path, default=None, help="step 1: a pi0 run directory (export, processor.json)"
    )
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="step 1: build a full-size pi0 with random weights (seeded) on --dataset, exported as a run does",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        default=ROOT / "data" / "metaworld",
        help="step 1 with --full-size: LeRobot dataset",
    )
    parser.add_argument(
        "--frames", type=int, default=3, help="step 1: frames to compare, spread over the dataset"
    )
    parser.add_argument("--seed", type=int, default=0, help="step 1: weights (--full-size) and noise")
    parser.add_argument("--atol", type=float, default=ACTION_ATOL, help="step 2: actions, dataset units")
    args = parser.parse_args(argv)
    if args.side == "ours" and (args.run is None) == (not args.full_size):
        parser.error("step 1 (ours) needs exactly one of --run RUN_DIR and --full-size")
    return args


# ----------------------------------------------------------------------------------- step 1: ours
def _build_full_size_run(run_dir: Path, dataset: Path, seed: int) -> None:
    """A full-size pi0 (random weights from `seed`) exported into `run_dir` by the trainer's own writers:
    policy.safetensors, processor.json and pretrained_model/ (config.json, model.safetensors, processor files).
    PaliGemma's tokenizer cannot be downloaded here: a word-level stand-in of its size is saved beside."""
    import torch

    from vla.data.metadata import DatasetMetadata
    from vla.data.processor import BatchProcessor
    from vla.data.tokenizer import save_word_level_tokenizer
    from vla.models import build_policy
    from vla.models.factory import resolve_config
    from vla.training.cli import compose
    from vla.training.data import check_tokenizer, processor_config
    from vla.training.export import LEROBOT_DIR, lerobot_config_for, write_export, write_lerobot_processor_for

    meta = DatasetMetadata(dataset)
    cameras = list(zip(meta.camera_keys, resolve_config("pi0").cameras))  # dataset key -> model camera
    words = sorted({word for task in meta.tasks for word in task.lower().split()})
    tokenizer_dir = save_word_level_tokenizer(run_dir.parent / "paligemma_stand_in_tokenizer", words)
    camera_map = ", ".join(f"{key}: {camera}" for key, camera in cameras)
    cfg = compose(
        [
            "model=pi0",
            "data=lerobot",
            f"data.root={dataset.resolve()}",
            f"data.camera_map={{{camera_map}}}",
            f"data.tokenizer_path={tokenizer_dir.resolve()}",
        ]
    )
    policy_config = resolve_config(cfg.model.preset, **cfg.model.policy_overrides())
    tokenizer = check_tokenizer(cfg.data, policy_config)
    processor = BatchProcessor.from_dataset(processor_config(cfg.data, policy_config), meta, tokenizer)
    torch.manual_seed(seed)
    policy = build_policy(policy_config)
    # A seeded perturbation of every weight (norm scales at 1, zero biases included), so the actions
    # depend on all of them.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            for chunk in parameter.view(-1).split(1 << 22):  # 16 MB at a time: the full size is 12 GiB
                chunk.add_(torch.randn(chunk.shape, generator=generator).mul_(0.02))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "processor.json").write_text(json.dumps(processor.state_dict(), indent=1))
    write_export(
        policy.state_dict(),
        policy.config,
        run_dir,
        lerobot_config_for(policy.config, processor.config, meta.features),
    )
    write_lerobot_processor_for(run_dir / LEROBOT_DIR, policy.config, processor, meta.features, meta.stats)
    del policy
    gc.collect()


def _frame_indices(count: int, total: int) -> list[int]:
    step = max(total // (count + 1), 1)
    return [min((k + 1) * step, total - 1) for k in range(count)]


def run_ours(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    from vla.data.reader import LeRobotDataset
    from vla.eval.policy_runner import load_run_policy, run_dataset_root
    from vla.training.export import LEROBOT_DIR

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.full_size:
        run_dir = out / "run"
        start = time.perf_counter()
        _build_full_size_run(run_dir, args.dataset, args.seed)
        print(f"built and exported a full-size pi0 into {run_dir} ({time.perf_counter() - start:.0f} s)")
        dataset = args.dataset.resolve()
    else:
        run_dir = args.run.resolve()
        dataset = run_dataset_root(run_dir)
        if dataset is None:
            print(f"error: the dataset of {run_dir} (its data.root) cannot be found", file=sys.stderr)
            return 2
    pretrained = run_dir / LEROBOT_DIR
    if not (pretrained / "policy_preprocessor.json").is_file():
        print(
            f"error: {pretrained} has no LeRobot processor files; write them with "
            f"`python scripts/export_lerobot.py {run_dir}`",
            file=sys.stderr,
        )
        return 2
    actor = load_run_policy(run_dir, seed=args.seed)
    config = actor.policy.config
    if config.kind != "pi0":
        print(f"error: {run_dir} trained a {config.kind} policy; LeRobot's is pi0", file=sys.stderr)
        return 2
    reader = LeRobotDataset(dataset)
    indices = _frame_indices(args.frames, len(reader))
    generator = torch.Generator().manual_seed(args.seed)
    keys = [*actor.processor.config.camera_map, actor.processor.config.state_key]
    tensors: dict[str, torch.Tensor] = {}
    tasks = []
    seconds = []
    for frame, index in enumerate(indices):
        item = reader[index]
        tasks.append(str(item["task"]))
        for key in keys:
            tensors[f"{frame}/item/{key}"] = item[key].contiguous()
        observation = actor.processor.observation([item])
        tensors[f"{frame}/state"] = observation.state[0, : actor.processor.state_dim].contiguous()
        tensors[f"{frame}/tokens"] = observation.tokenized_prompt[0].contiguous()
        tensors[f"{frame}/mask"] = observation.tokenized_prompt_mask[0].to(torch.uint8).contiguous()
        noise = torch.randn((1, config.action_horizon, config.max_action_dim), generator=generator)
        tensors[f"{frame}/noise"] = noise[0].contiguous()
        start = time.perf_counter()
        actions = actor.sample([item], noise=noise)
        seconds.append(time.perf_counter() - start)
        tensors[f"{frame}/actions"] = torch.from_numpy(actions[0]).contiguous()
        # The postprocessor alone (any size): a normalised chunk and our un-normalisation of it.
        normalised = torch.randn((1, config.action_horizon, config.max_action_dim), generator=generator)
        tensors[f"{frame}/normalised"] = normalised[0, :, : actor.processor.action_dim].contiguous()
        tensors[f"{frame}/unnormalised"] = actor.processor.unnormalize_actions(normalised)[0].contiguous()
    save_file(tensors, str(out / PARITY_FILE))
    manifest = {
        "run": str(run_dir),
        "pretrained_model": str(pretrained),
        "dataset": str(dataset),
        "indices": indices,
        "tasks": tasks,
        "keys": keys,
        "state_key": actor.processor.config.state_key,
        "action_dim": actor.processor.action_dim,
        "lerobot_model": (pretrained / "config.json").is_file(),
        "ours_sample_s": seconds,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"{len(indices)} frames of {dataset} and our actions written to {out / PARITY_FILE}")
    return 0


# ----------------------------------------------------------------------------------- step 2: LeRobot
def _max_abs(a: Any, b: Any) -> float:
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def run_lerobot(args: argparse.Namespace) -> int:
    import lerobot
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi0.configuration_pi0 import PI0Config
    from safetensors.torch import load_file

    out = args.out
    manifest = json.loads((out / MANIFEST).read_text())
    ours = load_file(str(out / PARITY_FILE))
    pretrained = Path(manifest["pretrained_model"])
    policy = None
    if manifest["lerobot_model"]:
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy

        cfg = PreTrainedConfig.from_pretrained(str(pretrained))
        cfg.device = "cpu"
        start = time.perf_counter()
        policy = PI0Policy.from_pretrained(str(pretrained), config=cfg, strict=True)
        policy.eval()
        print(f"PI0Policy.from_pretrained({pretrained}): {time.perf_counter() - start:.0f} s")
    else:
        cfg = PI0Config(device="cpu")
    preprocessor, postprocessor = make_pre_post_processors(cfg, pretrained_path=str(pretrained))
    dataset = LeRobotDataset("local/parity", root=manifest["dataset"], video_backend="pyav")
    state_key = manifest["state_key"]
    rows = []
    for frame, index in enumerate(manifest["indices"]):
        item = dataset[index]
        row: dict[str, Any] = {"frame": frame, "index": index, "task": item["task"]}
        row["task_equal"] = item["task"] == manifest["tasks"][frame]
        row["item_max_abs"] = max(
            _max_abs(item[key], ours[f"{frame}/item/{key}"]) for key in manifest["keys"]
        )
        batch = preprocessor({key: item[key] for key in manifest["keys"]} | {"task": item["task"]})
        tokens = batch["observation.language.tokens"][0]
        mask = batch["observation.language.attention_mask"][0]
        row["tokens_equal"] = bool(torch.equal(tokens.long(), ours[f"{frame}/tokens"].long()))
        row["mask_equal"] = bool(torch.equal(mask.bool(), ours[f"{frame}/mask"].bool()))
        row["state_max_abs"] = _max_abs(batch[state_key][0], ours[f"{frame}/state"])
        unnormalised = postprocessor(ours[f"{frame}/normalised"].unsqueeze(0))
        row["postprocessor_max_abs"] = _max_abs(unnormalised[0], ours[f"{frame}/unnormalised"])
        if policy is not None:
            noise = ours[f"{frame}/noise"].unsqueeze(0)
            start = time.perf_counter()
            chunk = policy.predict_action_chunk(batch, noise=noise)
            row["lerobot_chunk_s"] = time.perf_counter() - start
            chunk = postprocessor(chunk)
            row["chunk_max_abs"] = _max_abs(chunk[0], ours[f"{frame}/actions"])
            row["action_scale"] = float(ours[f"{frame}/actions"].abs().max())
            # select_action draws its own noise: hand it ours through the model's sampler.
            policy.reset()
            policy.model.sample_noise = lambda shape, device, noise=noise: noise.to(device)
            first = postprocessor(policy.select_action(batch))
            row["select_action_max_abs"] = _max_abs(first[0], ours[f"{frame}/actions"][0])
        rows.append(row)
    failures = []
    for row in rows:
        checks = {
            "task": row["task_equal"],
            "item": row["item_max_abs"] <= PIXEL_ATOL,
            "tokens": row["tokens_equal"] and row["mask_equal"],
            "state": row["state_max_abs"] <= STATE_ATOL,
            "postprocessor": row["postprocessor_max_abs"] <= args.atol,
        }
        if policy is not None:
            checks["chunk"] = row["chunk_max_abs"] <= args.atol
            checks["select_action"] = row["select_action_max_abs"] <= args.atol
        row["passed"] = all(checks.values())
        failures += [f"frame {row['frame']}: {name}" for name, ok in checks.items() if not ok]
    report = {
        "lerobot_version": lerobot.__version__,
        "torch_version": torch.__version__,
        "pretrained_model": str(pretrained),
        "model_checked": policy is not None,
        "tolerances": {"actions": args.atol, "state": STATE_ATOL, "pixels": PIXEL_ATOL},
        "frames": rows,
        "failures": failures,
    }
    (out / REPORT).write_text(json.dumps(report, indent=1))
    print(f"LeRobot {lerobot.__version__} on {pretrained}:")
    for row in rows:
        parts = [
            f"frame {row['frame']} (index {row['index']}):",
            f"item {row['item_max_abs']:.1e}",
            f"tokens {'=' if row['tokens_equal'] and row['mask_equal'] else '!='}",
            f"state {row['state_max_abs']:.1e}",
            f"postprocessor {row['postprocessor_max_abs']:.1e}",
        ]
        if policy is not None:
            parts += [
                f"chunk {row['chunk_max_abs']:.1e} (|a| up to {row['action_scale']:.2f})",
                f"select_action {row['select_action_max_abs']:.1e}",
            ]
        print("  " + "  ".join(parts) + ("  ok" if row["passed"] else "  FAIL"))
    print(
        f"report: {out / REPORT}" + (f"; {len(failures)} failed: {failures}" if failures else "; all passed")
    )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side == "lerobot":
        return run_lerobot(args)
    from vla.training.user_errors import report_user_errors

    return report_user_errors(lambda: run_ours(args))


if __name__ == "__main__":
    sys.exit(main())
