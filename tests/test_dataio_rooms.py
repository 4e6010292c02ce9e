"""shardgen/dataio/ in rooms: each imports only the rooms below it, no module takes another's private name, and a
room's public names resolve while importing the room stays cheap."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from shardgen.dataio import _type_checking_imports

ROOT = Path(__file__).resolve().parents[1]
DATAIO = ROOT / "shardgen" / "dataio"
ORDER = ["rundir", "prompts", "shards", "resume"]  # lowest first (shardgen/dataio/__init__.py)


def _imports(path: Path):
    """(imported module, imported names) of every import in ``path``, lazy and TYPE_CHECKING ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


def test_every_module_is_in_a_room_and_imports_only_rooms_below_it():
    flat = sorted(p.name for p in DATAIO.glob("*.py") if p.name != "__init__.py")
    assert flat == [], f"modules outside the rooms: {flat}"
    assert sorted(p.name for p in DATAIO.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ORDER)
    upward = []
    for room in ORDER:
        for path in sorted((DATAIO / room).glob("*.py")):
            for module, _ in _imports(path):
                parts = module.split(".")
                if parts[:2] == ["shardgen", "dataio"] and len(parts) > 2 and ORDER.index(parts[2]) > ORDER.index(room):
                    upward.append(f"{room}/{path.name} imports {module}")
    assert upward == []


def test_no_module_imports_a_private_name_of_another():
    private = []
    for path in sorted(ROOT.glob("shardgen/**/*.py")) + sorted(ROOT.glob("jobs/*.py")) + sorted(ROOT.glob("parallel/*.py")):
        for module, names in _imports(path):
            private += [f"{path.relative_to(ROOT)}: {module}.{n}" for n in names
                        if module.split(".")[0] in ("shardgen", "parallel", "jobs") and n.startswith("_")]
    assert private == []


@pytest.mark.parametrize("room", ORDER)
def test_a_rooms_public_names_are_its_type_checking_imports_and_resolve(room):
    package = importlib.import_module(f"shardgen.dataio.{room}")
    assert package.__doc__ and sorted(_type_checking_imports(package.__file__)) == sorted(package.__all__)
    for name in package.__all__:
        value = getattr(package, name)
        assert getattr(value, "__module__", f"shardgen.dataio.{room}").startswith(f"shardgen.dataio.{room}"), name
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        package.nothing  # noqa: B018


def test_importing_the_rooms_and_the_schema_loads_no_numpy():
    """The config schema (imported by every job, --help included) takes constants from the rooms: that must not load
    the planner, the writer or their numpy."""
    code = ("import sys\nimport shardgen.config.schema\n"
            + "".join(f"import shardgen.dataio.{room}\n" for room in ORDER)
            + "from shardgen.dataio.prompts import MAX_PROMPT_CHARS\nfrom shardgen.dataio.rundir import LEASE_S\n"
            "print(sorted(m for m in ('numpy', 'PIL', 'pyarrow', 'av', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
