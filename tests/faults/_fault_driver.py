"""Run train.py with one fault injected (for tests/faults/test_process_faults.py).

    python tests/faults/_fault_driver.py <fault> <marker file> [hydra overrides...]

fault: "build" (data building hangs), "validation" (validation hangs), "step" (the third training
step hangs in forward/backward), "slow" (every training step takes at least SLOW_STEP_S seconds: a
sleep before its forward/backward, so the numbers do not change; the marker is not used) or "none".
Just before hanging, the driver creates the marker file, so the test knows the process is at that
moment. Exits with train.py's exit code.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLOW_STEP_S = 1.0


def _hang(marker: Path) -> None:
    marker.write_text("here")
    time.sleep(600)  # never returns within the test's bound: only a signal ends this


def main() -> None:
    fault, marker, *overrides = sys.argv[1:]
    marker_path = Path(marker)
    import vla.training.loop as loop

    if fault == "build":
        loop.build_data = lambda *a, **k: _hang(marker_path)
    elif fault == "validation":
        original = loop.Trainer._loss_inputs

        def loss_inputs(self, batch, stream):
            if stream == "val":
                _hang(marker_path)
            return original(self, batch, stream)

        loop.Trainer._loss_inputs = loss_inputs
    elif fault == "step":
        original_fb = loop.Trainer._forward_backward

        def forward_backward(self, batches):
            if self.step == 2:
                _hang(marker_path)
            return original_fb(self, batches)

        loop.Trainer._forward_backward = forward_backward
    elif fault == "slow":
        original_slow = loop.Trainer._forward_backward

        def slow_forward_backward(self, batches):
            time.sleep(SLOW_STEP_S)
            return original_slow(self, batches)

        loop.Trainer._forward_backward = slow_forward_backward
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
