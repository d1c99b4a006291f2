import sys
from pathlib import Path

# The trainer run helpers (tests/training/_trainer_runs.py) are imported by name.
_TRAINING = Path(__file__).resolve().parents[1] / "training"
if str(_TRAINING) not in sys.path:
    sys.path.insert(0, str(_TRAINING))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny trainer dataset of tests/training/conftest.py (matches _trainer_runs.TINY)."""
    from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset

    root = tmp_path_factory.mktemp("data") / "synthetic"
    ensure_synthetic_dataset(root, SyntheticConfig(episodes=8, episode_length=20, image_size=32))
    return root
