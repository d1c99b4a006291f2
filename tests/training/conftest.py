import sys
from pathlib import Path

# The gloo harness (tests/distributed), the policy batch helper (tests/models) and the checkpoint workers
# (this directory) are imported by name, here and in the ranks the harness spawns (spawn copies sys.path).
_TESTS = Path(__file__).resolve().parents[1]
for _directory in (_TESTS / "distributed", _TESTS / "models", _TESTS / "training"):
    if str(_directory) not in sys.path:
        sys.path.insert(0, str(_directory))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer tests' dataset: written once, matching tests/training/_trainer_runs.TINY."""
    from vla.data.synthetic import SyntheticConfig, ensure_synthetic_dataset

    root = tmp_path_factory.mktemp("data") / "synthetic"
    ensure_synthetic_dataset(root, SyntheticConfig(episodes=8, episode_length=20, image_size=32))
    return root
