import sys
from pathlib import Path

# harness.py and workers.py are imported by name here and in the spawned ranks.
sys.path.insert(0, str(Path(__file__).resolve().parent))
