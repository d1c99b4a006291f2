"""Training-time image augmentation: random crop / shift / affine, colour and sharpness jitter.

Configured like LeRobot's `ImageTransformsConfig` (`enable`, `max_num_transforms`, `random_order`,
`tfs`: name -> {weight, type, kwargs}): for every frame and camera, `max_num_transforms` of the listed
transforms are drawn without replacement (probability by weight) and applied in the listed order
(`random_order`: in the drawn order). With `max_num_transforms` >= the number of transforms, every
transform is applied to every frame: openpi's recipe is written that way (configs/image_transforms).

Transform types and their kwargs (ranges are [low, high]; a single number v means [1 - v, 1 + v] for
the colour factors, [-v, v] for hue and degrees):
    ColorJitter        brightness, contrast, saturation, hue (factors as torchvision's; applied in
                       that fixed order, where torchvision permutes them per call)
    SharpnessJitter    sharpness (0: the 3x3-smoothed image, 1: unchanged, 2: sharpened)
    RandomAffine       degrees, translate (max fraction of width, height), scale; black fill
    RandomResizedCrop  scale (area fraction), ratio (aspect); the crop is resized back to H x W
    RandomShift        pad: a shift of up to `pad` pixels in x and y, edges replicated (DrQ's
                       augmentation for pixel policies learnt from few demonstrations)

Geometric transforms (RandomAffine, RandomResizedCrop, RandomShift) leave wrist cameras alone when
`wrist` is "color_only" (openpi's choice: the wrist view moves with the gripper); "all" augments them
like the others, "none" leaves them untouched altogether.

Determinism: every draw comes from a generator seeded by (seed, epoch, dataset index, camera), so a
frame gets the same augmentation at any number of ranks or workers and after a resume, and a new one
every epoch. Images are (B, 3, H, W) uint8 (or float in [0, 1]) and come back in the same shape and
dtype; work is batched over the frames that drew a transform, and frames that drew none are returned
bit for bit. This module only runs on training batches: validation, open-loop and closed-loop
evaluation never build an ImageAugmenter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

COLOR_TYPES = ("ColorJitter", "SharpnessJitter")
GEOMETRIC_TYPES = ("RandomAffine", "RandomResizedCrop", "RandomShift")
TRANSFORM_TYPES = COLOR_TYPES + GEOMETRIC_TYPES
WRIST_MODES = ("color_only", "all", "none")
# The item key (epoch, index) that BatchLoader adds to training items and that seeds their draws.
AUGMENT_KEY = "augment_key"
_KWARGS = {
    "ColorJitter": ("brightness", "contrast", "saturation", "hue"),
    "SharpnessJitter": ("sharpness",),
    "RandomAffine": ("degrees", "translate", "scale"),
    "RandomResizedCrop": ("scale", "ratio"),
    "RandomShift": ("pad",),
}


@dataclass
class ImageTransformConfig:
    """One transform: its type (see the module docstring), its draw weight and its kwargs."""

    weight: float = 1.0
    type: str = "ColorJitter"
    kwargs: dict[str, Any] = field(default_factory=dict)


def lerobot_default_tfs() -> dict[str, ImageTransformConfig]:
    """LeRobot 0.4's ImageTransformsConfig.tfs defaults (also configs/image_transforms/lerobot.yaml, the
    trainer's default group option)."""
    return {
        "brightness": ImageTransformConfig(1.0, "ColorJitter", {"brightness": [0.8, 1.2]}),
        "contrast": ImageTransformConfig(1.0, "ColorJitter", {"contrast": [0.8, 1.2]}),
        "saturation": ImageTransformConfig(1.0, "ColorJitter", {"saturation": [0.5, 1.5]}),
        "hue": ImageTransformConfig(1.0, "ColorJitter", {"hue": [-0.05, 0.05]}),
        "sharpness": ImageTransformConfig(1.0, "SharpnessJitter", {"sharpness": [0.5, 1.5]}),
        "affine": ImageTransformConfig(1.0, "RandomAffine", {"degrees": [-5.0, 5.0], "translate": [0.05, 0.05]}),
    }


@dataclass
class ImageTransformsConfig:
    """`data.image_transforms` (LeRobot's names). enable: off by default (validation and evaluation are
    never augmented either way). tfs: name -> ImageTransformConfig (or its dict form); empty here, so a
    Hydra preset replaces the set instead of adding to it: the trainer's default group option
    (configs/image_transforms/lerobot.yaml) holds LeRobot's six, `lerobot_default_tfs()` in Python.
    wrist_cameras: model camera names treated as wrist views (null: every camera whose name contains
    "wrist")."""

    enable: bool = False
    max_num_transforms: int = 3
    random_order: bool = False
    tfs: dict[str, Any] = field(default_factory=dict)
    wrist: str = "color_only"
    wrist_cameras: list[str] | None = None

    def __post_init__(self) -> None:
        prefix = "data.image_transforms"
        if self.wrist not in WRIST_MODES:
            raise ValueError(f"{prefix}.wrist={self.wrist!r} is not one of {list(WRIST_MODES)}")
        if isinstance(self.max_num_transforms, bool) or self.max_num_transforms < 1:
            raise ValueError(f"{prefix}.max_num_transforms must be >= 1, got {self.max_num_transforms}")
        tfs = {}
        for name, spec in self.tfs.items():
            key = f"{prefix}.tfs.{name}"
            if not isinstance(spec, ImageTransformConfig):
                fields = {"weight", "type", "kwargs"}
                if not isinstance(spec, Mapping) or set(spec) - fields:
                    raise ValueError(f"{key} must be a dict with keys {sorted(fields)}, got {spec!r}")
                spec = ImageTransformConfig(**{k: spec[k] for k in spec})
                spec.kwargs = dict(spec.kwargs)
            tfs[str(name)] = spec
            if spec.type not in TRANSFORM_TYPES:
                raise ValueError(f"{key}.type={spec.type!r} is not one of {list(TRANSFORM_TYPES)}")
            if not (math.isfinite(spec.weight) and spec.weight >= 0):
                raise ValueError(f"{key}.weight must be a finite number >= 0, got {spec.weight}")
            unknown = sorted(set(spec.kwargs) - set(_KWARGS[spec.type]))
            if unknown or not spec.kwargs:
                raise ValueError(
                    f"{key}.kwargs {sorted(spec.kwargs)}: {spec.type} takes {list(_KWARGS[spec.type])}"
                    + (f" (unknown: {unknown})" if unknown else " (none given)")
                )
            _parse_kwargs(spec.type, dict(spec.kwargs), key)  # ranges checked here, at start-up
        self.tfs = tfs
        if self.enable and not any(spec.weight > 0 for spec in tfs.values()):
            raise ValueError(f"{prefix}.enable=true but no transform in {prefix}.tfs has a weight > 0")


def _range(value: Any, key: str, *, center: float, low_limit: float | None = None) -> tuple[float, float]:
    """A number v -> [center - v, center + v]; a pair -> itself. Checked to be ordered and finite."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{key} must be >= 0 as a single number, got {value}")
        low, high = center - float(value), center + float(value)
        if low_limit is not None:
            low = max(low, low_limit)
    else:
        pair = [float(v) for v in value]
        if len(pair) != 2:
            raise ValueError(f"{key} must be a number or a [low, high] pair, got {list(value)}")
        low, high = pair
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"{key} must be a finite range with low <= high, got [{low}, {high}]")
    if low_limit is not None and low < low_limit:
        raise ValueError(f"{key} must stay >= {low_limit}, got [{low}, {high}]")
    return low, high


def _parse_kwargs(kind: str, kwargs: dict[str, Any], key: str) -> dict[str, Any]:
    """Ranges per kwarg of one transform type, validated (errors name the full key)."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        k = f"{key}.kwargs.{name}"
        if name in ("brightness", "contrast", "saturation", "sharpness"):
            out[name] = _range(value, k, center=1.0, low_limit=0.0)
        elif name == "hue":
            out[name] = _range(value, k, center=0.0)
            if not -0.5 <= out[name][0] <= out[name][1] <= 0.5:
                raise ValueError(f"{k} must lie in [-0.5, 0.5], got {list(out[name])}")
        elif name == "degrees":
            out[name] = _range(value, k, center=0.0)
        elif name == "translate":
            pair = [float(v) for v in value]
            if len(pair) != 2 or not all(0.0 <= v <= 1.0 for v in pair):
                raise ValueError(f"{k} must be two fractions in [0, 1] (width, height), got {value}")
            out[name] = tuple(pair)
        elif name == "scale":
            out[name] = _range(value, k, center=1.0, low_limit=1e-3)
            if kind == "RandomResizedCrop" and out[name][1] > 1.0:
                raise ValueError(f"{k} is an area fraction in (0, 1], got {list(out[name])}")
        elif name == "ratio":
            out[name] = _range(value, k, center=1.0, low_limit=1e-3)
        elif name == "pad":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{k} must be an int >= 0 (pixels), got {value!r}")
            out[name] = value
    return out


def _generator(seed: int, epoch: int, index: int, camera: int) -> torch.Generator:
    # A fixed mixing (Python's hash() is salted per process); distinct from vla.training.noise's streams.
    mixed = ((seed * 1_000_003 + 7) * 1_000_033 + epoch) * 1_000_037 + camera
    return torch.Generator().manual_seed((mixed * 2_654_435_761 + index) % (2**63 - 1))


def _uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator, dtype=torch.float64))


class ImageAugmenter:
    """Applies an ImageTransformsConfig to camera batches; picklable (it runs in DataLoader workers).

    `augment(images, camera, keys)`: images (B, 3, H, W) uint8 or float [0, 1]; keys: B (epoch,
    dataset index) pairs; returns the same shape and dtype.
    """

    def __init__(self, config: ImageTransformsConfig, model_cameras: list[str], seed: int) -> None:
        self.config = config
        self.seed = int(seed)
        self.cameras = list(model_cameras)
        wrist = config.wrist_cameras
        self.wrist_cameras = set(wrist if wrist is not None else [c for c in model_cameras if "wrist" in c])
        self.names = [n for n, spec in config.tfs.items() if spec.weight > 0]
        self.specs = [config.tfs[n] for n in self.names]
        self.params = [_parse_kwargs(s.type, dict(s.kwargs), n) for n, s in zip(self.names, self.specs)]
        self.weights = torch.tensor([s.weight for s in self.specs], dtype=torch.float64)

    def _allowed(self, camera: str) -> list[int]:
        """Indices of the transforms this camera may draw."""
        if camera not in self.wrist_cameras or self.config.wrist == "all":
            return list(range(len(self.specs)))
        if self.config.wrist == "none":
            return []
        return [i for i, s in enumerate(self.specs) if s.type in COLOR_TYPES]

    def draws(self, camera: str, key: tuple[int, int], height: int, width: int) -> list[tuple[int, dict]]:
        """The (transform index, sampled parameters) a frame gets, in application order."""
        allowed = self._allowed(camera)
        if not allowed:
            return []
        generator = _generator(self.seed, key[0], key[1], self.cameras.index(camera))
        count = min(self.config.max_num_transforms, len(allowed))
        weights = self.weights[allowed]
        picked = torch.multinomial(weights, count, replacement=False, generator=generator).tolist()
        chosen = [allowed[i] for i in picked]
        if not self.config.random_order:
            chosen.sort()
        return [(i, self._sample(i, generator, height, width)) for i in chosen]

    def _sample(self, i: int, generator: torch.Generator, height: int, width: int) -> dict[str, Any]:
        kind, params = self.specs[i].type, self.params[i]
        if kind in COLOR_TYPES:
            return {name: _uniform(generator, *bounds) for name, bounds in params.items()}
        if kind == "RandomShift":
            pad = params["pad"]
            shift = torch.randint(-pad, pad + 1, (2,), generator=generator).tolist()
            return {"dx": shift[0], "dy": shift[1]}
        if kind == "RandomAffine":
            angle = _uniform(generator, *params.get("degrees", (0.0, 0.0)))
            tx, ty = params.get("translate", (0.0, 0.0))
            # torchvision rounds translations to whole pixels
            dx = round(_uniform(generator, -tx * width, tx * width))
            dy = round(_uniform(generator, -ty * height, ty * height))
            scale = _uniform(generator, *params.get("scale", (1.0, 1.0)))
            return {"angle": angle, "dx": dx, "dy": dy, "scale": scale}
        # RandomResizedCrop: area fraction and log-uniform aspect, then a uniform position
        area = _uniform(generator, *params.get("scale", (0.08, 1.0)))
        low, high = params.get("ratio", (3 / 4, 4 / 3))
        aspect = math.exp(_uniform(generator, math.log(low), math.log(high)))
        crop_w = min(1.0, math.sqrt(area * aspect))
        crop_h = min(1.0, math.sqrt(area / aspect))
        return {
            "w": crop_w,
            "h": crop_h,
            "x0": _uniform(generator, 0.0, 1.0 - crop_w),
            "y0": _uniform(generator, 0.0, 1.0 - crop_h),
        }

    def augment(self, images: Tensor, camera: str, keys: list[tuple[int, int]]) -> Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(keys):
            raise ValueError(f"expected (B={len(keys)}, 3, H, W) images for {camera!r}, got {tuple(images.shape)}")
        height, width = images.shape[-2:]
        plans = [self.draws(camera, key, height, width) for key in keys]
        if not any(plans):
            return images
        as_uint8 = images.dtype == torch.uint8
        out = images.to(torch.float32) / 255.0 if as_uint8 else images.to(torch.float32).clone()
        touched = torch.zeros(len(keys), dtype=torch.bool)
        if self.config.random_order:  # per-frame order: frame by frame
            for b, plan in enumerate(plans):
                for i, params in plan:
                    out[b : b + 1] = _apply(self.specs[i].type, out[b : b + 1], [params])
                touched[b] = bool(plan)
        else:  # one batched call per transform over the frames that drew it
            for i, spec in enumerate(self.specs):
                rows = [(b, params) for b, plan in enumerate(plans) for j, params in plan if j == i]
                if not rows:
                    continue
                drawn = [params for _, params in rows]
                if len(rows) == len(keys):  # every frame drew it: no gather / scatter
                    out = _apply(spec.type, out, drawn)
                else:
                    index = torch.tensor([b for b, _ in rows])
                    out[index] = _apply(spec.type, out[index], drawn)
                touched[[b for b, _ in rows]] = True
        out.clamp_(0.0, 1.0)
        result = out.mul_(255.0).round_().to(torch.uint8) if as_uint8 else out.to(images.dtype)
        if not touched.all():
            result[~touched] = images[~touched]  # frames that drew nothing: bit for bit
        return result


# -- the transforms, batched over frames (x: (N, 3, H, W) float in [0, 1]) ---------------------------
def _column(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1, 1)


def _gray(x: Tensor) -> Tensor:
    r, g, b = x.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def _apply(kind: str, x: Tensor, params: list[dict[str, Any]]) -> Tensor:
    if kind == "ColorJitter":
        for name in ("brightness", "contrast", "saturation", "hue"):
            if name not in params[0]:
                continue
            factor = _column([p[name] for p in params])
            if name == "brightness":
                x = (x * factor).clamp(0.0, 1.0)
            elif name == "contrast":
                mean = _gray(x).mean(dim=(1, 2, 3), keepdim=True)
                x = (factor * x + (1 - factor) * mean).clamp(0.0, 1.0)
            elif name == "saturation":
                x = (factor * x + (1 - factor) * _gray(x)).clamp(0.0, 1.0)
            else:
                x = _shift_hue(x, factor)
        return x
    if kind == "SharpnessJitter":
        return _sharpness(x, _column([p["sharpness"] for p in params]))
    if kind == "RandomShift":
        return _shift(x, params)
    return F.grid_sample(
        x, F.affine_grid(_thetas(kind, params, x.shape[-2:]), list(x.shape), align_corners=False),
        mode="bilinear", padding_mode="zeros", align_corners=False,
    )  # fmt: skip


def _thetas(kind: str, params: list[dict[str, Any]], hw: tuple[int, int]) -> Tensor:
    """(N, 2, 3) maps from output to input coordinates in affine_grid's normalised [-1, 1] frame."""
    height, width = hw
    rows = []
    for p in params:
        if kind == "RandomResizedCrop":
            cx, cy = 2 * (p["x0"] + p["w"] / 2) - 1, 2 * (p["y0"] + p["h"] / 2) - 1
            rows.append([[p["w"], 0.0, cx], [0.0, p["h"], cy]])
            continue
        # rotate by angle about the centre, scale, then translate; theta is the inverse map
        angle = math.radians(p["angle"])
        cos, sin = math.cos(angle) / p["scale"], math.sin(angle) / p["scale"]
        tx, ty = 2 * p["dx"] / width, 2 * p["dy"] / height
        inverse = [[cos, sin], [-sin, cos]]
        rows.append(
            [
                [inverse[0][0], inverse[0][1], -(inverse[0][0] * tx + inverse[0][1] * ty)],
                [inverse[1][0], inverse[1][1], -(inverse[1][0] * tx + inverse[1][1] * ty)],
            ]
        )
    return torch.tensor(rows, dtype=torch.float32)


def _shift(x: Tensor, params: list[dict[str, Any]]) -> Tensor:
    pad = max(max(abs(p["dx"]), abs(p["dy"])) for p in params)
    if pad == 0:
        return x
    height, width = x.shape[-2:]
    padded = F.pad(x, (pad, pad, pad, pad), mode="replicate")
    out = torch.empty_like(x)
    for n, p in enumerate(params):  # output pixel (y, x) shows input (y - dy, x - dx)
        top, left = pad - p["dy"], pad - p["dx"]
        out[n] = padded[n, :, top : top + height, left : left + width]
    return out


def _sharpness(x: Tensor, factor: Tensor) -> Tensor:
    """torchvision's adjust_sharpness: blend with the 3x3-smoothed image, borders kept."""
    if x.shape[-1] <= 2 or x.shape[-2] <= 2:
        return x
    kernel = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13.0
    kernel = kernel.expand(3, 1, 3, 3)
    smooth = x.clone()
    smooth[..., 1:-1, 1:-1] = F.conv2d(x, kernel, groups=3)
    return (factor * x + (1 - factor) * smooth).clamp(0.0, 1.0)


def _shift_hue(x: Tensor, shift: Tensor) -> Tensor:
    """Rotate hue by `shift` (fractions of a turn) in HSV, as torchvision's adjust_hue."""
    r, g, b = x.unbind(1)
    maxc, _ = x.max(dim=1)
    minc, _ = x.min(dim=1)
    delta = maxc - minc
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    hue = torch.where(
        maxc == r,
        ((g - b) / safe) % 6,
        torch.where(maxc == g, (b - r) / safe + 2, (r - g) / safe + 4),
    )
    hue = torch.where(delta > 0, hue / 6.0, torch.zeros_like(hue))
    hue = (hue + shift.view(-1, 1, 1)) % 1.0
    sat = torch.where(maxc > 0, delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc)), torch.zeros_like(maxc))
    value = maxc
    h6 = hue * 6.0
    sector = torch.floor(h6)
    frac = h6 - sector
    candidates = torch.stack(
        (value, value * (1 - sat), value * (1 - sat * frac), value * (1 - sat * (1 - frac))), dim=1
    )  # v, p, q, t
    # per hue sector, which candidate each of r, g, b takes: (v,t,p) (q,v,p) (p,v,t) (p,q,v) (t,p,v) (v,p,q)
    table = torch.tensor([[0, 3, 1], [2, 0, 1], [1, 0, 3], [1, 2, 0], [3, 1, 0], [0, 1, 2]])
    index = table[sector.long() % 6].permute(0, 3, 1, 2)  # (N, 3, H, W)
    return torch.gather(candidates, 1, index)
