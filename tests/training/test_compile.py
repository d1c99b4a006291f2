"""trainer.compile: per-block torch.compile gives eager's losses, resumes bit-identically, and logs its time."""

from __future__ import annotations

import pytest
import torch
from _trainer_runs import losses, run_in_process, summary, tiny_overrides

pytestmark = [pytest.mark.slow]

# No validation, open-loop evaluation or export: each would compile its own shapes (a minute on this CPU).
QUIET = ["trainer.val_every=1000", "trainer.open_loop_eval=false", "trainer.export_safetensors=false"]


@pytest.mark.timeout(1200)
def test_compiled_training_equals_eager_and_resumes_bit_identically(synthetic_dataset, tmp_path) -> None:
    steps = ["trainer.steps=4", "trainer.checkpoint_every=2", *QUIET]
    eager = tmp_path / "eager"
    run_in_process(tiny_overrides(synthetic_dataset, eager, *steps))
    compiled = tmp_path / "compiled"
    run_in_process(tiny_overrides(synthetic_dataset, compiled, *steps, "trainer.compile=true"))
    assert len(losses(compiled)) == 4
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), rtol=1e-4, atol=0)
    assert summary(compiled)["compile_s"] > 0 and summary(eager)["compile_s"] is None
    # Stop after step 2, resume with compile on: the same losses as the uninterrupted compiled run.
    split = tmp_path / "split"
    first = tiny_overrides(
        synthetic_dataset, split, *steps, "trainer.compile=true", "trainer.schedule_steps=4"
    )
    run_in_process([*first, "trainer.steps=2"])
    run_in_process([*first, "trainer.resume=auto"])
    assert losses(split) == losses(compiled)


@pytest.mark.timeout(900)
def test_the_compile_benchmark_reports_both_sides(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from _trainer_runs import ROOT

    out = tmp_path / "compile.json"
    result = subprocess.run(
        [sys.executable, "scripts/bench_compile.py", "--presets", "pi0_tiny", "--batch", "8", "--steps", "3",
         "--warmup", "1", "--threads", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["units_compiled"] == 4 and len(run["times"]["eager"]) == len(run["times"]["compiled"]) == 3
    assert run["speedup"] == pytest.approx(run["eager_s"] / run["compiled_s"])
    assert run["max_rel_loss_diff"] < 1e-4 and "pi0_tiny" in result.stdout
    # The profile splits each step into matrix products and the rest; the bound is the eager step over
    # its GEMM seconds, so it is above 1 exactly when something besides GEMMs takes time.
    for side in ("profile_eager", "profile_compiled"):
        assert 0 < run[side]["gemm_s"] < run[side]["step_s"]
    assert run["speedup_bound"] == pytest.approx(1 / run["gemm_share"]) and run["speedup_bound"] > 1
