import sys
from pathlib import Path

# The trainer run helpers (tests/training/_trainer_runs.py) are imported by name.
_TRAINING = Path(__file__).resolve().parents[1] / "training"
if str(_TRAINING) not in sys.path:
    sys.path.insert(0, str(_TRAINING))
