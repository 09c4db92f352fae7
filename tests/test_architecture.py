"""docs/architecture.md is true: every module has one row and every row a module, each module imports only rows
above it (or its own), the doc's import check passes, few long functions, checkpoint modules reading no other
object's private attributes, short table cells, and each concrete claim the doc keeps (who imports what,
constants, paths, the diagram) holds in the code."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
from pathlib import Path, PurePosixPath

import fastio
from fastio.pipelines import Pipeline

ROOT = Path(fastio.__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()
CELL_CAP = 400


def cells(line: str) -> list[str]:
    """A markdown table row's cells (a ``|`` inside backticks stays in its cell)."""
    out, cur, code = [], "", False
    for ch in line.strip()[1:-1]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [*out, cur.strip()]


def table(header: str) -> list[list[str]]:
    """The rows (cells) of the doc's table whose header row starts with ``header``."""
    lines = DOC.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(cells(line))
    return rows


def module_name(rel: str) -> str:
    """``fastio.x.y`` of a path relative to ``fastio/`` (``converters/...`` installs as ``fastio.converters``)."""
    parts = list(PurePosixPath(rel).with_suffix("").parts)
    return ".".join(["fastio", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def package_modules() -> dict[str, Path]:
    found = {module_name(p.relative_to(ROOT / "fastio").as_posix()): p for p in (ROOT / "fastio").rglob("*.py")}
    found.update({module_name(p.relative_to(ROOT).as_posix()): p for p in (ROOT / "converters").glob("*.py")})
    return found


MODULES = package_modules()


def named(cell: str) -> tuple[list[str], list[str]]:
    """The modules (``fastio.x``) and folders (``x/``) a cell names: ``a/b.py``, then ``c.py`` in the same
    folder, ``(+ `__init__.py`)``, or a folder ``a/`` for its modules no other row names."""
    modules, folders, folder = [], [], ""
    for token in re.findall(r"`([^`]+)`", cell):
        if token.endswith("/"):
            folders.append(token)
            folder = token
        elif token.endswith(".py"):
            folder = token.rsplit("/", 1)[0] + "/" if "/" in token else folder
            modules.append(module_name(token if "/" in token else folder + token))
    return modules, folders


ROWS = table("| module | owns |")


def row_of() -> dict[str, int]:
    """Each module's row: the row naming it, else the row of the deepest folder holding it."""
    rows, folders = {}, []
    for i, row in enumerate(ROWS):
        modules, found = named(row[0])
        for m in modules:
            assert m in MODULES, f"row {row[0]} names {m}: no such module"
            assert m not in rows, f"{m} has two rows"
            rows[m] = i
        folders += [(f, i) for f in found]
    for m in MODULES:
        path = m.removeprefix("fastio.").replace(".", "/") + "/"
        holding = [(f, i) for f, i in folders if path.startswith(f)]
        if m not in rows and holding:
            rows[m] = max(holding, key=lambda fi: len(fi[0]))[1]
    return rows


@functools.cache
def imports(path: Path, *, in_functions: bool) -> frozenset[str]:
    """What a module imports (``a.b`` and ``a.b.name`` for ``from a.b import name``); at import time (also
    ``if TYPE_CHECKING:`` blocks) or anywhere."""
    found: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not in_functions:
                continue
            if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.update([child.module, *(f"{child.module}.{a.name}" for a in child.names)])
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            walk(child)

    walk(ast.parse(path.read_text()))
    return frozenset(found)


def importers(package: str, *, in_functions: bool = True) -> set[str]:
    """The package modules that import ``package`` (or a module under it)."""
    return {m for m, p in MODULES.items()
            if any(t == package or t.startswith(package + ".") for t in imports(p, in_functions=in_functions))}


def fastio_imports(module: str) -> set[str]:
    return {t for t in imports(MODULES[module], in_functions=True) if t in MODULES and t != module}


def test_every_module_has_one_row_and_every_row_names_a_module():
    rows = row_of()
    assert not [m for m in MODULES if m not in rows], "modules without a row in docs/architecture.md"
    assert sorted(set(rows.values())) == list(range(len(ROWS))), "a row that names no module"


def test_a_module_imports_only_rows_above_it_or_its_own_row():
    rows = row_of()
    bad = [f"{m} ({ROWS[rows[m]][0]}) imports {t} ({ROWS[rows[t]][0]})" for m, p in MODULES.items()
           for t in imports(p, in_functions=False) if t in rows and rows[t] > rows[m]]
    assert not bad, bad


def test_the_import_check_of_the_doc_passes_over_the_package_bench_and_examples(monkeypatch):
    snippet = DOC[DOC.index("**Import check**"):]
    code = snippet[snippet.index("```python\n") + 10:]
    code = code[:code.index("```")]
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/architecture.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.endswith("no import cycle") for line in lines), lines
    counts = re.search(r"(\d+) package modules, (\d+) of bench/ and examples/", lines[0]).groups()
    assert f"Result: {counts[0]} package modules and {counts[1]} of `bench/` and `examples/`" in DOC


def test_pipelines_import_read_never_the_reverse():
    """The read set, the feeder and the typed messages between a kind and the read set (read/protocol.py) import
    no pipeline: the folders depend one way (issue 41)."""
    read = {m for m in MODULES if m.startswith("fastio.read.") or m == "fastio.read"}
    pipelines = {m for m in MODULES if m.startswith("fastio.pipelines.") or m == "fastio.pipelines"}
    assert not importers("fastio.pipelines") & read, sorted(importers("fastio.pipelines") & read)
    assert importers("fastio.read") & pipelines  # they do use read/ (its protocol, ReadBatch)


def test_no_function_in_the_package_is_longer_than_50_lines():
    long = [f"{p.relative_to(ROOT)}:{n.name}" for p in (ROOT / "fastio").rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 50]
    assert not long, long


def test_checkpoint_modules_read_no_other_objects_private_attributes():
    """The Checkpointer's parts are given what they use (the restore: a ``Restorer`` given the Commit, the rank
    group, the engine getter), not the Checkpointer to reach into: ``x._name`` only on ``self``, on a module, or on
    a dependency's object inside its engine adapter (``restore.py`` read ``ck._commit``, ``ck._ranks``, ...)."""
    adapters = {"torchsnapshot_engine.py", "dcp_engine.py"}
    found = []
    for p in sorted((ROOT / "fastio" / "checkpoint").rglob("*.py")):
        tree = ast.parse(p.read_text())
        modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names}
        found += [f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                  and not (isinstance(n.value, ast.Name) and (n.value.id in ("self", "cls") or n.value.id in modules))
                  and p.name not in adapters]
    assert not found, found


def test_table_cells_are_short():
    long = [(len(c), c[:60]) for line in DOC.split("\n") if line.lstrip().startswith("| ")
            for c in cells(line.strip()) if len(c) > CELL_CAP]
    assert not long, long


def claims(phrase: str) -> list[tuple[list[str], str]]:
    """(modules of the row, the text after ``phrase`` up to ``;``) for each row whose notes say ``phrase``."""
    rows = row_of()
    out = []
    for i, row in enumerate(ROWS):
        for text in re.findall(re.escape(phrase) + r"([^;]*)", row[2]):
            out.append(([m for m in MODULES if rows.get(m) == i], text))
    return out


def targets(text: str) -> list[str]:
    """The backticked names of a claim: fastio paths (``a/b.py``, ``a/``) as modules, others as packages."""
    return [module_name(t) if t.endswith((".py", "/")) else t for t in re.findall(r"`([^`]+)`", text)]


def test_only_importer_claims_hold():
    checked = claims("the only importer of ") + claims("the only importers of ")
    assert len(checked) >= 5
    for modules, text in checked:
        for package in re.findall(r"`([\w.]+)`", text):
            assert importers(package) <= set(modules), (package, importers(package) - set(modules))
            assert importers(package) & set(modules), (package, modules)


def test_imports_only_and_imports_no_claims_hold():
    for modules, text in claims("imports only "):
        allowed = targets(text)
        for m in modules:
            assert {t for t in fastio_imports(m) if not any(t == a or t.startswith(a + ".") for a in allowed)} \
                <= set(modules), (m, fastio_imports(m))
    for modules, _ in claims("imports nothing of fastio"):
        for m in modules:
            assert not fastio_imports(m) - set(modules), (m, fastio_imports(m))
    checked = claims("imports no ") + [(m, "`torch`") for m, _ in claims("torch-free")]
    assert len(checked) >= 5
    for modules, text in checked:
        for target in targets(text):
            assert not importers(target) & set(modules), (modules, target)


def test_imported_only_when_used_claims_hold():
    checked = []
    rows = row_of()
    for i, row in enumerate(ROWS):
        for package in targets(" ".join(re.findall(r"(`[\w./]+`) imported only when used", row[2]))):
            modules = {m for m in MODULES if rows.get(m) == i}
            checked.append(package)
            assert importers(package) & modules, package
            assert not importers(package, in_functions=False) & modules, package
    assert len(checked) >= 6


def test_the_dependency_table_names_every_importer_in_the_package():
    names = {"nvidia-dali": "nvidia.dali", "torch>=2.6": "torch", "xxhash": "xxhash", "obstore": "obstore",
             "pillow": "PIL", "tokenizers": "tokenizers", "pyarrow": "pyarrow", "av": "av", "click": "click",
             "tqdm": "tqdm", "torchsnapshot": "torchsnapshot", "zstandard": "zstandard",
             "torch.distributed.checkpoint": "torch.distributed.checkpoint"}
    checked = 0
    for dependency, _, imported_by in table("| dependency | job |"):
        packages = [p for key, p in names.items() if f"`{key}" in dependency.split(" (")[0]]
        if not packages:
            continue
        listed = set()
        for token in re.findall(r"`([^`]+)`", imported_by):
            prefix = token.removeprefix("fastio/")
            listed |= {m for m in MODULES if m == module_name(prefix) or (
                prefix.endswith("/") and m.startswith(module_name(prefix) + "."))}
        found = set().union(*(importers(p) for p in packages))
        assert found and found <= listed, (dependency, sorted(found - listed))
        checked += 1
    assert checked >= 10


def test_package_inits_import_only_lazy():
    for package in ("fastio", "fastio.checkpoint", "fastio.convert", "fastio.dataset", "fastio.formats",
                    "fastio.order", "fastio.read", "fastio.report", "fastio.tokens", "fastio.integrations"):
        assert fastio_imports(package) <= {"fastio.lazy"}, (package, fastio_imports(package))
        assert not imports(MODULES[package], in_functions=True) - {"__future__", "__future__.annotations",
                                                                   "fastio.lazy", "fastio.lazy.lazy_exports"}


def test_storage_moves_bytes_only():
    """The folder table: ``storage/`` knows no dataset layout (it imports no module of another folder)."""
    for m in MODULES:
        if m.startswith("fastio.storage."):
            assert all(t.startswith("fastio.storage") or t in ("fastio.errors", "fastio.progress")
                       for t in fastio_imports(m)), (m, fastio_imports(m))


def test_no_other_module_spells_the_manifests_own_keys():
    """The manifest's row: its own keys are spelled in ``dataset/manifest.py`` only (the schema's one home)."""
    (modules, text), = claims("no other module spells its keys ")
    keys = set(re.findall(r"`(\w+)`", text))
    assert len(keys) >= 5 and "fastio.dataset.manifest" in modules
    spelled = {(m, node.value) for m, p in MODULES.items() if m not in modules
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.Constant) and node.value in keys}
    assert not spelled, spelled


def test_constants_the_doc_states_hold():
    stated = re.findall(r"`([A-Z][A-Z0-9_]+) = ([^`]+)`", DOC)
    assert len(stated) >= 6
    defined: dict[str, set] = {}
    for p in MODULES.values():
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        defined.setdefault(target.id, set()).add(repr(node.value.value))
    for name, value in stated:
        assert value in defined.get(name, set()) or repr(ast.literal_eval(value)) in defined.get(name, set()), \
            (name, value, defined.get(name))


def test_commit_marker_versions_read_are_the_docs():
    from fastio.checkpoint import record
    assert record.READ_VERSIONS == (1, 2, 3)
    assert "versions 1 to 3" in next(row[1] for row in ROWS if row[0] == "`checkpoint/record.py`")


def test_paths_the_doc_names_exist():
    paths = set(re.findall(r"`((?:tests|bench|examples|docs)/[\w./{},-]+)`", DOC))
    paths |= {f"fastio/{p}" for row in ROWS for p in re.findall(r"`([\w/]+\.py)`", row[0]) if "/" in p}
    assert len(paths) >= 20
    ignored = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    missing = [p for p in paths if "{" not in p and p.strip("/") not in ignored and not (ROOT / p).exists()]
    assert not missing, missing


def test_the_diagram_shows_index_mixtures_and_every_pipeline_object():
    diagram = DOC[DOC.index("## The path of one sample"):DOC.index("## Rooms")]
    objects = [n for n in fastio.__all__ if isinstance(getattr(fastio, n), type)
               and issubclass(getattr(fastio, n), Pipeline) and n != "Pipeline"]
    assert len(objects) >= 6
    for name in ["fastio index", "Mixture", *objects]:
        assert name in diagram, name
