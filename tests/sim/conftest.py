import sys
from pathlib import Path

import pytest

import vla.sim  # noqa: F401  (chooses headless rendering before mujoco is first imported)

pytest.importorskip("metaworld", reason="the simulation tests need the sim extra: pip install -e '.[sim]'")

# _sim_fixtures is imported by name here and in the tests; the trainer helpers live in tests/training.
for _directory in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "training"):
    if str(_directory) not in sys.path:
        sys.path.insert(0, str(_directory))

from _sim_fixtures import sim_demos  # noqa: E402


@pytest.fixture(scope="session")
def sim_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recording of _sim_fixtures.sim_demos() (a few seconds)."""
    from vla.sim import ensure_sim_dataset

    return ensure_sim_dataset(tmp_path_factory.mktemp("sim") / "metaworld", sim_demos())
