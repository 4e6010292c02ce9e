"""The project's own code is reached through imports a reader can see: speed/ imports no model family (the families
hand their blocks and hooks down), code is imported by a computed name only where a registry discovers its members,
and a family's spec names its code by reference, never by a ``"module:function"`` string."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the registries' discovery (each imports the members of one package), and the two lookups by a library's own
# names: diffusers' lazy pipeline modules (models/loader.py) and the optional FlashAttention-4 package (fa4.py)
DISCOVERY = {"shardgen/families/__init__.py", "parallel/registry.py", "shardgen/speed/techniques.py",
             "shardgen/dataio/prompts/formats.py", "shardgen/dataio/__init__.py", "shardgen/models/loader.py",
             "shardgen/speed/fa4.py"}


def _sources():
    for folder in ("shardgen", "parallel", "jobs"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_speed_imports_no_model_family():
    upward = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / "shardgen" / "speed").glob("*.py"))
              for m in _imported_modules(p) if m.startswith("shardgen.families")]
    assert upward == []


def test_code_is_imported_by_a_computed_name_only_in_registries():
    by_name = sorted(str(p.relative_to(ROOT)) for p in _sources() if "import_module(" in p.read_text())
    assert set(by_name) <= DISCOVERY, sorted(set(by_name) - DISCOVERY)


def test_a_family_names_its_code_by_reference():
    from shardgen.families import families, tiny_models

    for fam in families():
        assert fam.speed_hooks is None or callable(fam.speed_hooks), fam.name
        assert all(callable(v) for v in (*fam.fused_blocks.values(), *fam.own_components.values())), fam.name
        for dummy in fam.dummies.values():
            assert all(":" not in spec.cls for spec in dummy.components.values() if isinstance(spec.cls, str))
    for tiny in tiny_models().values():
        assert callable(tiny.path) and callable(tiny.transformer_config), tiny.source


def test_reading_the_families_loads_no_torch():
    """A launch compares its fingerprint (which names the tiny models' versions) before torch is imported."""
    import subprocess
    import sys

    code = ("import sys; from shardgen.families import tiny_models; from shardgen.models.versions import "
            "model_version; tiny_models(); print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
