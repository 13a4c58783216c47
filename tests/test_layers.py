"""The layering contract (docs/ARCHITECTURE.md): no module imports a module of a higher layer.

Imports are read from the source with ``ast``, function-level ones included, so a late import inside a function
counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tfmem", "passes", "orion_par", "models", "experiments", "tests")

# The layers below tfmem's top (optimizer, report, CLI, demo, ...), lowest first.
TFMEM_LAYERS = {"tfmem.errors": "base", "tfmem.units": "base", "tfmem.gcpause": "base", "tfmem.ir": "ir",
                "tfmem.sim": "sim", "tfmem.testbed": "testbed", "tfmem.pipeline": "pipeline"}
# Each layer and the layers it may import from, besides itself.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "ir": {"base"},
    "sim": {"base", "ir"},
    "testbed": {"base", "ir"},
    "pipeline": {"base", "ir", "sim"},
    "passes": {"base", "ir", "sim", "pipeline"},
    "top": {"base", "ir", "sim", "testbed", "pipeline", "passes"},
    "orion_par": set(),
    "models": {"base", "top", "orion_par"},
    "experiments": {"base", "ir", "sim", "testbed", "pipeline", "passes", "top", "models", "orion_par"},
    "tests": {"base", "ir", "sim", "testbed", "pipeline", "passes", "top", "models", "orion_par", "experiments"},
}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name; None outside the project."""
    for prefix, layer in TFMEM_LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    top = module.split(".")[0]
    if top == "tfmem":
        return "top"
    return top if top in FOLDERS else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for every import in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                # ``from tfmem import examples`` imports a module; ``from tfmem import optimize`` a name.
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub, None) if is_module(sub) else (node.lineno, base, a.name))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports of ``module`` that reach a layer it may not use; for models and experiments, also private names
    of other modules (they use public API only); for tests, other test modules, and experiments outside the
    experiments' own smoke tests."""
    own = layer_of(module)
    if own is None:
        return []
    out = []
    for line, target, name in imports(source, module, is_package):
        layer = layer_of(target)
        if layer is None:
            continue
        if layer != own and layer not in ALLOWED[own]:
            out.append(f"{module}:{line} ({own}) imports {target} ({layer})")
        if (own in ("models", "experiments") and name is not None and name.startswith("_")
                and not name.startswith("__") and target != module):
            out.append(f"{module}:{line} imports the private name {target}.{name}")
        if own == "tests" and target.startswith("tests.test_"):
            out.append(f"{module}:{line} imports another test module, {target} (shared code: tests/helpers.py)")
        if own == "tests" and layer == "experiments" and "experiments" not in module.rpartition(".")[2]:
            out.append(f"{module}:{line} imports {target}: only the experiments' smoke tests may")
    return out


def sources() -> list[Path]:
    return sorted(p for f in FOLDERS for p in (ROOT / f).rglob("*.py"))


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_higher_layer_or_a_private_name(path: Path) -> None:
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("tfmem.sim.memsim", "from passes.planner import Planner\n",
     ["tfmem.sim.memsim:1 (sim) imports passes.planner (passes)"]),
    ("tfmem.ir.graph", "def f():\n    from tfmem.sim import costmodel\n",
     ["tfmem.ir.graph:2 (ir) imports tfmem.sim.costmodel (sim)"]),
    ("tfmem.testbed.runner", "import tfmem.optimizer\n", ["tfmem.testbed.runner:1 (testbed) imports tfmem.optimizer (top)"]),
    ("orion_par.analyzer", "from tfmem import optimize\n", ["orion_par.analyzer:1 (orion_par) imports tfmem (top)"]),
    ("experiments.x", "from passes.planner import _greedy\n",
     ["experiments.x:1 imports the private name passes.planner._greedy"]),
    ("tests.test_x", "import experiments.planner\n",
     ["tests.test_x:1 imports experiments.planner: only the experiments' smoke tests may"]),
    ("tests.test_x", "from tests.test_ir import chain\n",
     ["tests.test_x:1 imports another test module, tests.test_ir (shared code: tests/helpers.py)"]),
    ("passes.planner", "from tfmem.sim.memsim import simulate\nfrom tfmem.pipeline import Pass\n", []),
])
def test_the_contract_catches_what_it_forbids(module: str, source: str, expected: list[str]) -> None:
    assert violations(source, module) == expected
