"""LeRobot's processor files for a pi0 policy directory (`pretrained_model/`), in LeRobot 0.4.x's layout.

LeRobot's inference path (`make_pre_post_processors(cfg, pretrained_path=...)`, used by `lerobot-eval`)
rebuilds the policy's pre- and post-processing from four files beside `config.json`:

    policy_preprocessor.json                                       the steps of make_pi0_pre_post_processors:
        rename_observations, to_batch, pi0_new_line, tokenizer, device, normalizer (step 5)
    policy_preprocessor_step_5_normalizer_processor.safetensors     the normaliser's statistics
    policy_postprocessor.json                                      unnormalizer (step 0), device
    policy_postprocessor_step_0_unnormalizer_processor.safetensors  the same statistics

The statistics are flat float32 tensors named `<feature>.<stat>` (`action.mean`, `observation.state.std`,
images as (3, 1, 1)), as LeRobot's NormalizerProcessorStep.state_dict() writes them. They do not depend
on the model's size. Written by the end-of-run export and by scripts/export_lerobot_processor.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vla.atomic import write_file_atomically
from vla.data.normalize import REQUIRED_STATS, NormMode

PREPROCESSOR = "policy_preprocessor"
POSTPROCESSOR = "policy_postprocessor"
NORMALIZER_STEP = 5  # its index in make_pi0_pre_post_processors' input steps
NORMALIZER_FILE = f"{PREPROCESSOR}_step_{NORMALIZER_STEP}_normalizer_processor.safetensors"
UNNORMALIZER_FILE = f"{POSTPROCESSOR}_step_0_unnormalizer_processor.safetensors"
PROCESSOR_FILES = (f"{PREPROCESSOR}.json", NORMALIZER_FILE, f"{POSTPROCESSOR}.json", UNNORMALIZER_FILE)
LEROBOT_EPS = 1e-8  # NormalizerProcessorStep's default
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what LeRobot's pi0 processor loads


def flat_stats(stats: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """{feature: {stat: array}} -> {"feature.stat": float32 array} (LeRobot's flattened state dict)."""
    flat: dict[str, np.ndarray] = {}
    for feature in sorted(stats):
        for name in sorted(stats[feature]):
            value = np.asarray(stats[feature][name], dtype=np.float32)
            flat[f"{feature}.{name}"] = np.ascontiguousarray(value.reshape(1) if value.ndim == 0 else value)
    return flat


def processor_documents(
    *,
    input_features: Mapping[str, Mapping[str, Any]],
    output_features: Mapping[str, Mapping[str, Any]],
    norm_map: Mapping[str, str],
    tokenizer_name: str,
    max_length: int,
    device: str = "cpu",
    eps: float = LEROBOT_EPS,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON of policy_preprocessor.json and policy_postprocessor.json.

    input_features / output_features: `config.json`'s ({key: {"type": VISUAL|STATE|ACTION, "shape"}});
    norm_map: its normalization_mapping; tokenizer_name: what `AutoTokenizer.from_pretrained` loads.
    """
    features = {k: dict(v) for k, v in {**input_features, **output_features}.items()}
    norm = dict(norm_map)
    preprocessor = {
        "name": PREPROCESSOR,
        "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {"registry_name": "pi0_new_line_processor", "config": {}},
            {
                "registry_name": "tokenizer_processor",
                "config": {
                    "max_length": int(max_length),
                    "task_key": "task",
                    "padding_side": "right",
                    "padding": "max_length",
                    "truncation": True,
                    "tokenizer_name": tokenizer_name,
                },
            },
            {"registry_name": "device_processor", "config": {"device": device, "float_dtype": None}},
            {
                "registry_name": "normalizer_processor",
                "config": {"eps": eps, "features": features, "norm_map": norm},
                "state_file": NORMALIZER_FILE,
            },
        ],
    }
    postprocessor = {
        "name": POSTPROCESSOR,
        "steps": [
            {
                "registry_name": "unnormalizer_processor",
                "config": {"eps": eps, "features": {k: dict(v) for k, v in output_features.items()}, "norm_map": norm},
                "state_file": UNNORMALIZER_FILE,
            },
            {"registry_name": "device_processor", "config": {"device": device, "float_dtype": None}},
        ],
    }
    return preprocessor, postprocessor


def write_lerobot_processor(
    directory: Path | str,
    *,
    input_features: Mapping[str, Mapping[str, Any]],
    output_features: Mapping[str, Mapping[str, Any]],
    norm_map: Mapping[str, str],
    stats: Mapping[str, Mapping[str, Any]],
    tokenizer_name: str,
    max_length: int,
    eps: float = LEROBOT_EPS,
) -> list[Path]:
    """Write the four processor files into `directory` (each atomically); returns their paths.

    stats: {feature: {stat: array}}; every feature the normaliser does not leave alone (STATE and ACTION
    unless mapped to IDENTITY) must have the stats its mode needs, or LeRobot would pass it through
    un-normalised. Raises ValueError naming what is missing.
    """
    from safetensors.numpy import save_file

    for key, feature in {**input_features, **output_features}.items():
        mode = norm_map.get(feature["type"], "IDENTITY")
        absent = [n for n in REQUIRED_STATS[NormMode(mode)] if n not in stats.get(key, {})]
        if absent:
            raise ValueError(
                f"LeRobot's processor normalises {key!r} with {mode} but its stats lack {absent}; "
                f"stats exist for {sorted(stats)}. Recompute the dataset stats (meta/stats.json)."
            )
    pre, post = processor_documents(
        input_features=input_features,
        output_features=output_features,
        norm_map=norm_map,
        tokenizer_name=tokenizer_name,
        max_length=max_length,
        eps=eps,
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = flat_stats(stats)
    written = []
    for name, document in ((f"{PREPROCESSOR}.json", pre), (f"{POSTPROCESSOR}.json", post)):
        text = json.dumps(document, indent=2)
        written.append(write_file_atomically(directory / name, lambda tmp, text=text: tmp.write_text(text)))
    for name in (NORMALIZER_FILE, UNNORMALIZER_FILE):
        written.append(write_file_atomically(directory / name, lambda tmp: save_file(tensors, str(tmp))))
    return written


__all__ = [
    "LEROBOT_EPS",
    "PALIGEMMA_TOKENIZER",
    "PROCESSOR_FILES",
    "flat_stats",
    "processor_documents",
    "write_lerobot_processor",
]
