import sys
from pathlib import Path

# The gloo harness (tests/distributed), the policy batch helper (tests/models) and the checkpoint workers
# (this directory) are imported by name, here and in the ranks the harness spawns (spawn copies sys.path).
_TESTS = Path(__file__).resolve().parents[1]
for _directory in (_TESTS / "distributed", _TESTS / "models", _TESTS / "training"):
    if str(_directory) not in sys.path:
        sys.path.insert(0, str(_directory))
