"""Architecture rules that a test can see: one-way dependencies and a cheap `import dmuon`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_after_import(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return {line.split(".")[0] for line in out.stdout.split()}


def test_importing_dmuon_loads_torch_only() -> None:
    loaded = _modules_after_import("import dmuon")
    forbidden = {"vla", "hydra", "omegaconf", "accelerate", "transformers", "scipy", "triton"}
    assert "torch" in loaded
    assert not loaded & forbidden, loaded & forbidden


def _imports_of(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    pattern = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.MULTILINE)
    for path in (ROOT / package).rglob("*.py"):
        found[str(path.relative_to(ROOT))] = set(pattern.findall(path.read_text()))
    return found


def test_dmuon_imports_only_torch_and_the_standard_library() -> None:
    allowed_third_party = {"torch", "scipy", "triton", "numpy"}
    for path, modules in _imports_of("dmuon").items():
        for module in modules:
            top = module.split(".")[0]
            assert (
                top == "dmuon"
                or top in allowed_third_party
                or top in sys.stdlib_module_names
                or top == "__future__"
            ), f"{path} imports {module}"


def test_vla_models_hold_modules_only() -> None:
    for path, modules in _imports_of("vla/models").items():
        for module in modules:
            assert not re.match(r"(accelerate|hydra|omegaconf|dmuon|vla\.training|vla\.data)\b", module), (
                f"{path} imports {module}"
            )


def test_vla_data_never_imports_models_or_training() -> None:
    for path, modules in _imports_of("vla/data").items():
        for module in modules:
            assert not re.match(r"(vla\.models|vla\.training|accelerate|hydra)\b", module), (
                f"{path} imports {module}"
            )


def test_only_vla_training_touches_accelerate() -> None:
    for package in ("vla/models", "vla/data", "vla/eval", "dmuon"):
        for path, modules in _imports_of(package).items():
            assert not any(m.startswith("accelerate") for m in modules), f"{path} imports accelerate"
