"""Fixtures: small LeRobot datasets written by our writer (see _lerobot_fixtures)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _lerobot_fixtures import WrittenDataset, write_dataset


@pytest.fixture
def make_dataset(tmp_path: Path) -> Callable[..., WrittenDataset]:
    counter = iter(range(1000))

    def make(lengths: list[int] | None = None, use_videos: bool = False, **kwargs: Any) -> WrittenDataset:
        return write_dataset(tmp_path / f"ds{next(counter)}", lengths or [5, 7, 9], use_videos, **kwargs)

    return make


@pytest.fixture(scope="session")
def image_dataset(tmp_path_factory: pytest.TempPathFactory) -> WrittenDataset:
    """Images embedded in parquet (lossless): read-back must be exact."""
    return write_dataset(tmp_path_factory.mktemp("image_ds"), [5, 7, 9], use_videos=False)


@pytest.fixture(scope="session")
def video_dataset(tmp_path_factory: pytest.TempPathFactory) -> WrittenDataset:
    """AV1 videos, three episodes concatenated per camera file."""
    return write_dataset(tmp_path_factory.mktemp("video_ds"), [5, 7, 9], use_videos=True, codec="av1")
