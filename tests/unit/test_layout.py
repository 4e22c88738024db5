"""The package's layout: no two modules import each other (an import at call time counts too)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "custom" / "fedlabels"


def _modules() -> dict:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, modules: dict) -> set:
    """The package's modules ``name`` imports anywhere in its file (``from X import Y`` counts X, and X.Y
    where that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names]
            # "from . import b" imports the module b; the package counts only for a name defined in it
            candidates = subs + ([] if all(m in modules for m in subs) else [target])
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name}
    return found


def test_the_import_reader_sees_relative_and_call_time_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    from . import c\n")
    modules = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py", "p.c": pkg / "c.py"}
    assert imports("p.a", pkg / "a.py", modules) == {"p.b", "p.c"}


def test_no_two_modules_import_each_other():
    modules = _modules()
    deps = {name: imports(name, path, modules) for name, path in modules.items()}
    circles = [(a, b) for a, b in itertools.combinations(sorted(modules), 2) if b in deps[a] and a in deps[b]]
    assert not circles, f"modules that import each other: {circles}"


def test_a_site_process_imports_neither_ignite_nor_matplotlib_and_the_executor_module_no_training_stack():
    """The job's client script and the executor mark ignite and matplotlib absent before MONAI is imported
    (fedlabels.flare.lean); the site's code still imports and builds a bundle's training transforms and
    network without them. Importing the executor (as the job writer does) imports no torch or MONAI."""
    import subprocess
    import sys

    probe = """
import sys
import fedlabels.flare.executor
assert not {"torch", "monai"} & set(sys.modules), sorted({"torch", "monai"} & set(sys.modules))
from fedlabels.flare.lean import skip_unused_imports
assert skip_unused_imports() == ["ignite", "matplotlib"]
import fedlabels.flare.client
from fedlabels.bundle import bundle_path, network, read
parser = read(bundle_path("cxr_resnet18"))
parser.get_parsed_content("train#preprocessing", instantiate=True)
network(bundle_path("cxr_resnet18"), {"widen_factor": 0.25})
print(sorted(m for m in ("ignite", "matplotlib") if sys.modules.get(m) is not None))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
