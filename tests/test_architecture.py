"""docs/architecture.md is true: the floors table covers every module once, no floor imports one above it and no
import cycle joins folders or modules (imports inside functions counted), each "must not" of a floor holds, the
rules list holds, what goes back up the picture is what the code calls, each contract names test files that
exist, and the page is at most 200 lines. ``python tests/test_architecture.py`` prints the floors' imports."""

from __future__ import annotations

import ast
import functools
import graphlib
import re
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()
MAX_LINES = 200
CELL_CAP = 400

# Imports that go up the floors today, each (importing module, imported floor), each named in docs/architecture.md.
# Any other upward import fails, and so does an entry here that the code no longer has.
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none today: an entry is (importing module, imported floor)


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


def section(title: str) -> str:
    """The text of the doc's ``## title`` section."""
    start = DOC.index(f"\n## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


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


def outside_modules() -> dict[str, Path]:
    """``bench/`` (run as ``python -m bench.NAME``) and ``examples/`` (scripts: a sibling by its bare name)."""
    found = {f"bench.{p.stem}".removesuffix(".__init__"): p for p in (ROOT / "bench").glob("*.py")}
    return found | {p.stem: p for p in (ROOT / "examples").glob("*.py")}


MODULES = package_modules()
OUTSIDE = outside_modules()
FLOORS = table("| floor | owns |")


def floor_key(module: str) -> str:
    """A module's floor key as the table spells it: ``x/`` for a folder's modules, ``x.py`` for a top-level one."""
    if module == "fastio":
        return "__init__.py"
    top = module.split(".")[1]
    return f"{top}.py" if (ROOT / "fastio" / f"{top}.py").is_file() else f"{top}/"


def floor_of() -> dict[str, int]:
    """Each floor key's row in the table (bottom floor: row 0)."""
    rows = {}
    for i, row in enumerate(FLOORS):
        for key in re.findall(r"`([^`]+)`", row[0]):
            assert key not in rows, f"{key} has two rows"
            rows[key] = i
    return rows


ROW = floor_of()


def floor(module: str) -> int:
    """A module's row in the floors table."""
    key = floor_key(module)
    assert key in ROW, f"{module}: {key} has no row in the floors table of docs/architecture.md"
    return ROW[key]


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@functools.cache
def import_statements(path: Path) -> tuple[tuple[str, bool], ...]:
    """(target, inside a function?) of every import statement (``a.b`` and ``a.b.name`` for ``from a.b import
    name``), also in ``if TYPE_CHECKING:`` blocks."""
    found = []

    def walk(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.extend((t, inner) for t in [child.module, *(f"{child.module}.{a.name}" for a in child.names)])
            elif isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names)
            walk(child, inner)

    walk(tree(path), False)
    return tuple(found)


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module an import target names: its longest prefix that is a module."""
    parts = target.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), None)


def fastio_imports(module: str) -> set[str]:
    """The package modules ``module`` imports, inside functions too."""
    return {t for t in (resolve(t, MODULES) for t, _ in import_statements(MODULES[module])) if t and t != module}


def importers(package: str, *, at_import_time: bool = False) -> set[str]:
    """The package modules that import ``package`` (or a module under it)."""
    return {m for m, p in MODULES.items() for t, deferred in import_statements(p)
            if (t == package or t.startswith(package + ".")) and not (at_import_time and deferred)}


def floor_modules(i: int) -> set[str]:
    return {m for m in MODULES if ROW.get(floor_key(m)) == i}


def edges() -> set[tuple[str, str]]:
    """(module, imported module) over the package."""
    return {(m, t) for m in MODULES for t in fastio_imports(m)}


def test_every_module_has_one_floor_and_every_floor_has_modules():
    assert len(FLOORS) >= 10
    assert not [m for m in MODULES if floor_key(m) not in ROW], "modules whose folder or file has no row"
    assert not [k for k in ROW if not any(floor_key(m) == k for m in MODULES)], "a row naming no module"


def upward() -> set[tuple[str, str]]:
    """(module, imported floor) of every import that goes to a floor above the importer's."""
    return {(m, floor_key(t)) for m, t in edges() if floor(t) > floor(m)}


def test_no_floor_imports_one_above_it_but_the_known_edges():
    found = upward()
    assert not found - KNOWN_UPWARD, sorted(found - KNOWN_UPWARD)
    assert not KNOWN_UPWARD - found, f"gone from the code, delete from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - found)}"


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        return err.args[1]
    return None


def folder_graph() -> dict[str, set[str]]:
    """Each folder (or top-level module) and the others it imports, the known upward edges left out."""
    graph: dict[str, set[str]] = {floor_key(m): set() for m in MODULES}
    for m, t in edges():
        if floor_key(m) != floor_key(t) and (m, floor_key(t)) not in KNOWN_UPWARD:
            graph[floor_key(m)].add(floor_key(t))
    return graph


def test_no_import_cycle_between_folders():
    assert cycle(folder_graph()) is None, cycle(folder_graph())


def test_no_import_cycle_between_modules_of_the_package_bench_and_examples():
    known = MODULES | OUTSIDE
    graph = {m: {r for t, _ in import_statements(p) if (r := resolve(t, known)) and r != m} for m, p in known.items()}
    assert cycle(graph) is None, cycle(graph)
    outside = {"bench", *(m for m in OUTSIDE if "." not in m)}
    bad = [(m, t) for m, p in MODULES.items() for t, _ in import_statements(p) if t.split(".")[0] in outside]
    assert not bad, f"the package imports bench/ or examples/: {bad}"


def floor_claims(phrase: str) -> list[tuple[int, str]]:
    """(row, the text after ``phrase`` up to ``;``) for each floor whose "must not" says ``phrase``."""
    return [(i, text) for i, row in enumerate(FLOORS) for text in re.findall(re.escape(phrase) + r"([^;]*)", row[2])]


def targets(text: str) -> list[str]:
    """The backticked names of a claim outside parentheses."""
    return re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", text))


def imports_target(modules: set[str], target: str) -> set[str]:
    """Those of ``modules`` that import ``target``: a floor key (``x/``, ``x.py``) or a dependency."""
    if target in ROW:
        return {m for m in modules if any(floor_key(t) == target for t in fastio_imports(m))}
    return modules & importers(target)


def test_imports_no_claims_hold():
    checked = floor_claims("imports no ") + [(i, "`torch`") for i, _ in floor_claims("torch-free")]
    assert len(checked) >= 20
    for i, text in checked:
        if text.startswith("other floor"):
            found = {(m, t) for m in floor_modules(i) for t in fastio_imports(m) - everywhere() if floor(t) != i}
            assert not found, (FLOORS[i][0], found)
            continue
        assert targets(text), (FLOORS[i][0], text)
        for target in targets(text):
            assert target in ROW or not target.endswith(("/", ".py")), f"{target}: no such floor"
            assert not imports_target(floor_modules(i), target), (FLOORS[i][0], target)


def test_imports_only_claims_hold():
    checked = floor_claims("imports only ")
    assert len(checked) >= 5
    for i, text in checked:
        allowed = {i} | {ROW[t] for t in targets(text)} | ({0} if "the bottom floor" in text else set())
        found = {(m, t) for m in floor_modules(i) for t in fastio_imports(m) if floor(t) not in allowed}
        assert not found, (FLOORS[i][0], found)


def test_only_importer_claims_hold():
    checked = [(package, path) for i, row in enumerate(FLOORS)
               for text in re.findall(r"the only importers? of ([^;]*)", row[2])
               for package, path in re.findall(r"`([\w.]+)` \(`([\w/.]+)`\)", text)]
    assert len(checked) >= 7
    for package, path in checked:
        named = {m for m in MODULES if m == module_name(path) or (path.endswith("/") and floor_key(m) == path)}
        assert named, path
        assert importers(package) and importers(package) <= named, (package, importers(package) - named)


def test_imported_only_when_used_claims_hold():
    checked = [(i, module_name(t) if t.endswith(".py") else t) for i, row in enumerate(FLOORS)
               for text in re.findall(r"((?:`[\w./]+`(?:, | and )?)+) imported only when used", row[2])
               for t in re.findall(r"`([\w./]+)`", text)]
    assert len(checked) >= 13
    for i, package in checked:
        assert importers(package) & floor_modules(i), (FLOORS[i][0], package)
        assert not importers(package, at_import_time=True) & floor_modules(i), (FLOORS[i][0], package)


RULES = section("Floors")[section("Floors").index("Rules the table does not show"):]


def rule(words: str) -> list[str]:
    """The modules the rule starting with ``words`` names: ``a/b.py``, then ``c.py`` in the same folder."""
    text = next(line for line in RULES.split("\n- ") if line.startswith(words))
    modules, folder = [], ""
    for token in re.findall(r"`([\w/.]+\.py)`", text):
        folder = token.rsplit("/", 1)[0] + "/" if "/" in token else folder
        modules.append(module_name(token if "/" in token else folder + token))
    assert all(m in MODULES for m in modules), [m for m in modules if m not in MODULES]
    return modules


def everywhere() -> set[str]:
    """The modules that every module may import, also ``order/`` and the leaves (the counted nouns' rule)."""
    return set(rule("Imported by every module"))


def test_what_every_module_may_import_is_a_bottom_leaf_that_floors_below_others_use():
    modules = everywhere()
    assert modules and all(floor(m) == 0 and not fastio_imports(m) for m in modules), modules
    assert all(importers(m) & floor_modules(ROW["order/"]) for m in modules), "order/ uses none of them"
    assert set(rule("Leaves, importing nothing of fastio")) >= modules


def test_leaves_import_nothing_of_fastio():
    leaves = rule("Leaves, importing nothing of fastio")
    assert len(leaves) >= 15
    assert not {m: fastio_imports(m) - everywhere() for m in leaves if fastio_imports(m) - everywhere()}


def test_torch_free_modules_in_floors_that_use_torch():
    modules = set(rule("Torch-free in floors that use torch"))
    assert len(modules) >= 10 and all(floor_modules(floor(m)) & importers("torch") for m in modules)
    assert not modules & importers("torch"), modules & importers("torch")


def test_lazy_package_inits_import_only_lazy():
    rule = next(line for line in RULES.split("\n- ") if "import only `lazy.py`" in line)
    packages = ["fastio"] + [module_name(f) for f in re.findall(r"`(\w+/)`", rule)]
    assert len(packages) >= 10
    for package in packages:
        assert not {t for t, _ in import_statements(MODULES[package])} - {
            "__future__", "__future__.annotations", "fastio.lazy", "fastio.lazy.lazy_exports"}, package


def test_only_the_manifest_module_spells_the_manifests_keys():
    rule = next(line for line in RULES.split("\n- ") if "are spelled in" in line)
    keys = set(re.findall(r"`(\w+)`", rule.split("are spelled in")[0]))
    home = module_name(re.search(r"are spelled in `([\w/.]+)` only", rule).group(1))
    assert len(keys) >= 5 and home in MODULES
    spelled = {(m, node.value) for m, p in MODULES.items() if m != home
               for node in ast.walk(tree(p)) if isinstance(node, ast.Constant) and node.value in keys}
    assert not spelled, spelled


def test_every_module_has_a_docstring():
    assert "Every module has a docstring" in RULES
    missing = [m for m, p in MODULES.items() if not (ast.get_docstring(tree(p)) or "").strip()]
    assert not missing, missing


def test_checkpoint_modules_read_no_other_objects_private_attributes():
    """The Checkpointer's parts are given what they use (the restore: a ``Restorer`` given the Commit, the rank
    group, the engine getter), not the Checkpointer to reach into: ``x._name`` only on ``self``, ``cls`` or a
    module, but in the engine adapters the rule names."""
    rule = next(line for line in RULES.split("\n- ") if "reads no other object's private attributes" in line)
    adapters = set(re.findall(r"`(\w+\.py)`", rule.split("engine adapters")[1]))
    assert adapters and all(any(p.name == a for p in MODULES.values()) for a in adapters), adapters
    found = []
    for m, p in MODULES.items():
        if floor_key(m) != "checkpoint/" or p.name in adapters:
            continue
        modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree(p)) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names}
        found += [f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree(p))
                  if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                  and not (isinstance(n.value, ast.Name) and (n.value.id in ("self", "cls") or n.value.id in modules))]
    assert not found, found


def test_no_function_is_longer_than_50_lines():
    assert "No function in `fastio/` is longer than 50 lines." in RULES
    long = [f"{p.relative_to(ROOT)}:{n.name}" for p in (ROOT / "fastio").rglob("*.py")
            for n in ast.walk(tree(p))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 50]
    assert not long, long


def test_the_page_is_short_with_short_cells():
    assert f"This page is at most {MAX_LINES} lines" in RULES
    assert len(DOC.splitlines()) <= MAX_LINES, len(DOC.splitlines())
    long = [(len(c), c[:60]) for line in DOC.split("\n") if line.startswith("| ")
            for c in cells(line) if len(c) > CELL_CAP]
    assert not long, long


def pipeline_hooks_called_in(floor: str) -> set[str]:
    """The attributes a floor takes of a pipeline object (a name or attribute called ``pipeline``)."""
    return {node.attr for m, p in MODULES.items() if floor_key(m) == floor for node in ast.walk(tree(p))
            if isinstance(node, ast.Attribute) and "pipeline" in (getattr(node.value, "id", None),
                                                                  getattr(node.value, "attr", None))}


def test_what_goes_back_up_is_what_the_code_does():
    from fastio.loader import Loader
    from fastio.pipelines import Pipeline

    picture = section("The path of one unit of data")
    items = re.split(r"\n\d\. |\n\nEverything else", picture)
    state, calls, down = items[1], items[2], items[-1]
    assert callable(Loader.state_dict) and callable(Loader.load_state_dict)
    assert "`Loader.state_dict()`" in state and "`Loader.load_state_dict()`" in state
    hooks = {t for t in re.findall(r"`(\w+)`", calls) if hasattr(Pipeline, t)}
    assert hooks == pipeline_hooks_called_in("read/"), (hooks, pipeline_hooks_called_in("read/"))
    torchft = next((item for item in items if "`TorchftReplicas`" in item), None)
    if torchft:
        from fastio.read.replicas import TorchftReplicas
        methods = [n for n in re.findall(r"`(\w+)`", torchft) if n != "TorchftReplicas"]
        assert len(methods) >= 3 and all(callable(getattr(TorchftReplicas, n, None)) for n in methods), methods
    asked = {t for t in re.findall(r"`(\w+)`", down) if hasattr(Pipeline, t)}
    assert len(asked) >= 2 and asked <= pipeline_hooks_called_in("loader.py"), asked


def test_the_page_names_each_known_upward_import():
    text = " ".join(section("Floors").split("\n\n")[1].split())
    claims = re.findall(r"((?:`[\w/]+\.py`,? (?:and )?)+)imports? `(\w+/)`", text)
    named = {(module_name(m), floor) for modules, floor in claims for m in re.findall(r"`([\w/]+\.py)`", modules)}
    assert named == KNOWN_UPWARD, (named, KNOWN_UPWARD)


def test_each_contract_names_test_files_that_exist():
    contracts = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- |\Z)", section("Contracts"), re.MULTILINE | re.DOTALL)
    assert len(contracts) >= 6
    for title, text in contracts:
        files = re.findall(r"`(tests/test_\w+\.py)`", text)
        assert files, f"{title}: names no test file"
        assert all((ROOT / f).is_file() for f in files), (title, [f for f in files if not (ROOT / f).is_file()])


def test_paths_the_doc_names_exist():
    paths = set(re.findall(r"`((?:tests|bench|examples|docs)/[\w./-]+)`", DOC))
    modules = {p for p in re.findall(r"\b(\w+/[\w/]+\.py)\b", DOC) if p.split("/")[0] + "/" in ROW}
    assert len(paths) >= 20 and len(modules) >= 8
    missing = [p for p in paths if not (ROOT / p).exists()] + [p for p in modules if module_name(p) not in MODULES]
    assert not missing, missing
    named_tests = re.findall(r"`(tests/test_\w+\.py)::(\w+)`", DOC)
    assert named_tests and all(f"\ndef {name}(" in (ROOT / f).read_text() for f, name in named_tests), named_tests


def test_constants_the_doc_states_hold():
    stated = re.findall(r"`([A-Z][A-Z0-9_]+) = ([^`]+)`", DOC)
    assert len(stated) >= 2
    defined: dict[str, set] = {}
    for p in MODULES.values():
        for node in tree(p).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        defined.setdefault(target.id, set()).add(node.value.value)
    for name, value in stated:
        assert ast.literal_eval(value) in defined.get(name, set()), (name, value, defined.get(name))


def test_the_names_on_disk_are_the_codes_constants():
    block = section("Contracts").split("### On disk")[1].split("```")[1]
    names = set(re.findall(r"(?<![\w.-])(\.?[\w-]+\.(?:json|fxi|fxp|fxs)|\.fastio-\w+|\.parts|\.merge|shards)(?![\w.-])",
                           block))
    constants = {node.value.value for p in MODULES.values() for node in tree(p).body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    assert len(names) >= 14 and not names - constants, sorted(names - constants)


def test_the_picture_shows_index_mixtures_every_pipeline_object_and_every_folder():
    import fastio
    from fastio.pipelines import Pipeline

    diagram = section("The path of one unit of data").split("```")[1]
    objects = [n for n in fastio.__all__ if isinstance(getattr(fastio, n), type)
               and issubclass(getattr(fastio, n), Pipeline) and n != "Pipeline"]
    assert len(objects) >= 6
    folders = [k for k in ROW if k.endswith("/") and k not in ("report/", "cli/")]
    for name in ["fastio index", "Mixture", "loader.py", *objects, *folders]:
        assert name in diagram, name


def defined(modules: set[str]) -> set[str]:
    """The classes and functions the modules define at their top level."""
    return {n.name for m in modules for n in tree(MODULES[m]).body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_classes_each_floor_owns_are_defined_on_it():
    checked = [(i, name) for i, row in enumerate(FLOORS) for name in re.findall(r"`([A-Z][a-z]\w*)`", row[1])]
    assert len(checked) >= 12
    missing = [(FLOORS[i][0], name) for i, name in checked if name not in defined(floor_modules(i))]
    assert not missing, missing


def test_the_classes_the_picture_names_are_defined():
    diagram = section("The path of one unit of data").split("```")[1]
    names = set(re.findall(r"\b[A-Z]\w*[a-z]\w*\b", diagram))  # capitalised words, not DEST or DALI
    outside = {"WebDataset", "Megatron", "Parquet", "DTensor", "Lightning", "Accelerate"}
    assert len(names - outside) >= 12
    assert not names - outside - defined(set(MODULES)), sorted(names - outside - defined(set(MODULES)))


def floors_report() -> list[str]:
    """Each floor, bottom first, with the floors it imports (an upward one marked)."""
    def label(i: int) -> str:
        return "bottom floor" if i == 0 else FLOORS[i][0].split(",")[0].strip("`")

    lines = []
    for i in range(len(FLOORS)):
        imported = sorted({floor(t) for m in floor_modules(i) for t in fastio_imports(m)} - {i})
        names = [label(j) + (" (UP)" if j > i else "") for j in imported]
        lines.append(f"{i:2} {label(i):14} imports: {', '.join(names) or '-'}")
    return lines


def test_the_doc_command_prints_every_floor():
    assert ".venv/bin/python tests/test_architecture.py" in section("Checking this page")
    lines = floors_report()
    assert len(lines) == len(FLOORS)
    assert sum("(UP)" in line for line in lines) == len({f for _, f in KNOWN_UPWARD})


if __name__ == "__main__":
    print("\n".join(floors_report()))
