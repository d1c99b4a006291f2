"""The README's two commands and CI stay in step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _opening_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_exactly_two_commands() -> None:
    install_and_run, install_and_test = _opening_commands()
    for command in (install_and_run, install_and_test):
        assert "pip install torch==2.13.0" in command  # the CPU wheel first, or pip pulls a CUDA build
        assert command.index("torch==2.13.0") < command.index('-e ".[dev,sim]"')  # sim: MetaWorld tests
    assert "pytest" in install_and_test


def test_ci_runs_the_readme_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    extracted = subprocess.run(
        ["bash", "-c", "grep -m1 -A1 '^# 2\\. ' README.md | tail -n 1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.strip()
    assert extracted == _opening_commands()[1]
    assert "README.md" in script


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))
)
def test_every_script_help_shows_its_defaults(script: str) -> None:
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(default:" in result.stdout, script


@pytest.mark.parametrize(("command", "status"), [("echo pytest-ran", 0), ("echo pytest-ran; exit 5", 5)])
def test_ci_runs_the_command_under_its_supervisor_and_keeps_its_status(
    tmp_path: Path, command: str, status: int
) -> None:
    (tmp_path / ".ci").mkdir()
    for name in ("run", "supervise.py"):
        (tmp_path / ".ci" / name).write_bytes((ROOT / ".ci" / name).read_bytes())
    (tmp_path / "README.md").write_text(f"# x\n\n```bash\n# 2. test\n{command}\n```\n")
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == f"+ {command}\npytest-ran\n"
