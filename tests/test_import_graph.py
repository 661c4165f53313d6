"""Imports run one way: kernels and ops, attention, models, engine, server, then the tools on top (bench, report,
prune, the CLI). Every import statement of the package is read, at module level or inside a function alike, so a
late import cannot hide a cycle."""
import ast
from pathlib import Path

import cpumoe

# lower rank: imported by higher ranks only; a package not listed here is a leaf helper anyone may import
RANK = {
    "_C": 0, "ops": 0, "experts": 0, "layer": 0, "routing": 0, "quant": 0, "reference": 0, "loader": 0, "logs": 0,
    "memory": 0, "torch_gemm": 0,
    "attention": 1,
    "models": 2, "presets": 2,
    "synthetic": 3, "engine": 3,
    "server": 4,
    "bench": 5, "report": 5, "prune": 5, "cli": 6, "__main__": 7,
}
ROOT = Path(cpumoe.__file__).parent


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "cpumoe" else None


def _imports(file: Path):
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def test_every_package_is_ranked():
    packages = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert packages <= set(RANK) | {"cli_args"}, sorted(packages - set(RANK))


def test_imports_run_one_way():
    upward = []
    for file in sorted(ROOT.rglob("*.py")):
        source = _package(".".join(("cpumoe",) + file.relative_to(ROOT).with_suffix("").parts))
        for line, module in _imports(file):
            target = _package(module)
            if source in RANK and target in RANK and RANK[target] > RANK[source]:
                upward.append(f"{file.relative_to(ROOT.parent)}:{line} ({source}) imports {module} ({target})")
    assert not upward, "\n".join(upward)
