"""The layout's promises (docs/ARCHITECTURE.md): the packages stack in layers, the project imports as a
package, one module talks to fsspec, the snapshot format needs no FSDP, and the commands run as scripts
without shadowing anything. And the tests' (docs/testing.md): they mirror the code, each module with
behaviour has a test file named for it, each test file names its module."""
import ast
import importlib.metadata
import inspect
import re
import subprocess
import sys
import types
from types import SimpleNamespace
from typing import Optional

import pytest
from helpers import MINGPT, REPO

SOURCE_FOLDERS = ("mingpt", "bench", "tests")


def python_files(*folders: str) -> list:
    return [path for folder in folders for path in (REPO / folder).rglob("*.py")]


def test_no_code_edits_the_import_path():
    """The project is installed (pip install -e .): no file edits the import path to reach its modules."""
    edits = re.compile(r"sys\.path\.(insert|append)|PYTHONPATH=str\(MINGPT\)")
    offenders = [str(path.relative_to(REPO)) for path in python_files(*SOURCE_FOLDERS)
                 if path.name != "test_layout.py" and edits.search(path.read_text())]
    assert offenders == []


def test_only_the_storage_door_imports_fsspec():
    imports = re.compile(r"^\s*(import fsspec|from fsspec)", re.M)
    importers = [str(path.relative_to(REPO)) for path in python_files("mingpt")
                 if imports.search(path.read_text())]
    assert importers == ["mingpt/common/files.py"]


def test_only_process_group_makes_process_groups():
    """Groups made anywhere else would get torch's default timeout, not the run's (test_process_group)."""
    makers = re.compile(r"\b(new_group|new_subgroups\w*|split_group|init_device_mesh)\(")
    found = [str(path.relative_to(REPO)) for path in python_files("mingpt")
             if makers.search(path.read_text())]
    assert found == ["mingpt/distributed/process_group.py"]


@pytest.mark.slow
def test_generating_text_loads_no_fsdp():
    code = "import sys, mingpt.generate; print('torch.distributed.fsdp' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_no_name_at_the_top_of_mingpt_shadows_a_module_others_import():
    """`python main.py` puts mingpt/ first on the import path: a mingpt/logging.py would replace the
    standard library's logging for torch and everyone else."""
    names = {path.stem for path in MINGPT.glob("*.py")} | {path.name for path in MINGPT.iterdir()
                                                           if (path / "__init__.py").exists()}
    installed = set(importlib.metadata.packages_distributions())
    assert names & (set(sys.stdlib_module_names) | installed) == set()


COMMAND_RUNNER = """
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as said, contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    print(script, said.getvalue().splitlines()[0] if said.getvalue() else "(nothing)")
"""


@pytest.mark.slow
def test_every_command_starts_from_inside_mingpt():
    """The README: every command works from the root and from inside mingpt/ (`python main.py`), where
    mingpt/ is first on the import path. Each command's --help, as `python <command> --help` run there
    would (one process for all: imports are what differs)."""
    commands = sorted(path.name for path in MINGPT.glob("*.py")
                      if 'if __name__ == "__main__":' in path.read_text())
    result = subprocess.run([sys.executable, "-c", COMMAND_RUNNER, *commands], cwd=MINGPT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    said = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert len(commands) >= 9 and list(said) == commands
    for command in commands:
        assert said[command].startswith(("usage:", "Train a GPT")), said


LAYERS = ("common", "model", "optimizer", "distributed", "tokens", "storage", "reporting", "planning")
"""mingpt's packages (and model.py, optimizer.py) from the ground up, as docs/ARCHITECTURE.md draws them. The
original's files and the commands at the top of mingpt/ stand on all of them."""

COMMANDS = ("convert_snapshot", "export_hf", "generate", "hellaswag", "launch", "main", "model_size", "plan",
            "plot_metrics", "prepare_data")
"""The scripts a user runs (the README's table of commands): each stands alone at the top, imported by
no other module of mingpt. The original's trainer.py, model.py and char_dataset.py are not commands."""

TOP = len(LAYERS)


def top_names(mingpt) -> set[str]:
    """The modules and packages at the top of mingpt/: what `python main.py` run inside mingpt/ finds
    by a bare name (`import trainer`)."""
    return ({path.stem for path in mingpt.glob("*.py")}
            | {path.name for path in mingpt.iterdir() if path.is_dir() and any(path.glob("*.py"))})


def project_imports(path, mingpt) -> set[str]:
    """The mingpt modules a file imports, read from its code: `from mingpt.storage import files` counts
    as mingpt.storage.files, `from ..reporting import metrics` in mingpt/storage/ as
    mingpt.reporting.metrics, and a bare `import trainer` (which works inside mingpt/) as mingpt.trainer."""
    package = ["mingpt", *path.relative_to(mingpt).parent.parts]  # an __init__.py's is its own folder
    local = top_names(mingpt)

    def absolute(name: str) -> str:
        return f"mingpt.{name}" if name.split(".")[0] in local else name

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {absolute(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).rstrip(".")
            else:
                base = absolute(node.module)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("mingpt.")}


def layer_of(module: str, mingpt) -> Optional[int]:
    """A module's layer: its package's (or model.py's, optimizer.py's) place in LAYERS, the top for the files at the top
    of mingpt/ (the original's and the commands), None for a folder the layers do not name."""
    name = module.split(".")[1]
    if name in LAYERS:
        return LAYERS.index(name)
    return TOP if (mingpt / f"{name}.py").exists() else None


def module_name(path, mingpt) -> str:
    return ".".join(["mingpt", *path.relative_to(mingpt).with_suffix("").parts])


def upward_imports(mingpt) -> list[str]:
    """Each import that runs up the layers, or from or into a folder that is in no layer."""
    found = []
    for path in sorted(mingpt.rglob("*.py")):
        module = module_name(path, mingpt)
        for imported in sorted(project_imports(path, mingpt)):
            here, there = layer_of(module, mingpt), layer_of(imported, mingpt)
            if here is None or there is None or there > here:
                found.append(f"{module} -> {imported}")
    return found


def unlayered_packages(mingpt) -> list[str]:
    """The folders of mingpt/ with code that LAYERS does not name, and the names in LAYERS that are no
    package of mingpt/ (model.py aside)."""
    folders = {path.parent.relative_to(mingpt).parts[0] for path in mingpt.glob("*/**/*.py")}
    packages = {name for name in LAYERS if (mingpt / name / "__init__.py").exists()}
    return sorted((folders - set(LAYERS)) | (set(LAYERS) - packages - {"model", "optimizer"}))


def command_imports(mingpt) -> list[str]:
    """Each import of a command by another module of mingpt: the commands stand alone at the top."""
    return [f"{module_name(path, mingpt)} -> {imported}"
            for path in sorted(mingpt.rglob("*.py"))
            for imported in sorted(project_imports(path, mingpt)) if imported.split(".")[1] in COMMANDS]


def test_each_package_imports_only_the_layers_below_it():
    assert upward_imports(MINGPT) == [], "imports that run up the layers of docs/ARCHITECTURE.md"


def test_every_package_has_a_layer():
    assert unlayered_packages(MINGPT) == [], "packages of mingpt/ not in LAYERS (and docs/ARCHITECTURE.md)"


def test_the_commands_are_the_scripts_at_the_top():
    scripts = {path.stem for path in MINGPT.glob("*.py") if 'if __name__ == "__main__":' in path.read_text()}
    assert scripts == set(COMMANDS)


def test_no_command_imports_another():
    assert command_imports(MINGPT) == [], "commands imported by other modules of mingpt"


def module_graph(mingpt) -> dict[str, set[str]]:
    """Each module of mingpt and the modules of mingpt it imports, at its top or inside a function
    (an imported name counts as its module's import)."""
    modules = {module_name(path, mingpt) for path in mingpt.rglob("*.py")}

    def module_of(name: str) -> Optional[str]:
        while name and name not in modules and f"{name}.__init__" not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {module_name(path, mingpt): {found for found in map(module_of, project_imports(path, mingpt))
                                        if found and not found.endswith("__init__")}
            for path in sorted(mingpt.rglob("*.py"))}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other round a circle (strongly connected, more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.get(module, ()):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_modules_import_each_other_round_a_circle():
    """Within a layer too, and with imports inside functions: a lower module that reaches up for one
    function (snapshot.py once took sharded_store's read_whole) ties its layer's modules into one."""
    assert import_circles(module_graph(MINGPT)) == []


def documented_layers() -> list[tuple[int, str, set[str]]]:
    """docs/ARCHITECTURE.md's table of layers: each row's layer, package and what it imports."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    table = text[text.index("| layer | package | owns | imports |"):].split("\n\n")[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)(?:/|\.py)` \|.*\| ([^|]*) \|$", table, re.M)
    return [(int(layer), package, set(re.findall(r"`([\w.]+)`", imports)))
            for layer, package, imports in rows]


def test_the_layers_are_those_of_architecture_md():
    """docs/ARCHITECTURE.md draws every package and command, and its table names the packages in the
    order of LAYERS, and what each imports: a package (`distributed`) or one of its modules
    (`storage.snapshot`)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    drawing = text[text.index("```\nmingpt/"):].split("\n```")[0]
    drawn = [f"{name}/" for name in LAYERS if name not in ("model", "optimizer")]
    drawn += [f"{name}.py" for name in ("model", "optimizer", *COMMANDS)]
    assert [name for name in drawn if not re.search(rf"(^|\s){re.escape(name)}(\s|$)", drawing, re.M)] == []
    rows = documented_layers()
    assert sorted((layer, package) for layer, package, _ in rows) == list(enumerate(LAYERS, start=1))
    undocumented = []
    for layer, package, allowed in rows:
        for path in sorted(MINGPT.rglob("*.py")):
            module = module_name(path, MINGPT)
            if layer_of(module, MINGPT) != layer - 1:
                continue
            for imported in sorted(project_imports(path, MINGPT)):
                target = imported.split(".")[1:]
                if target[0] != package and not {".".join(target[:1]), ".".join(target[:2])} & allowed:
                    undocumented.append(f"{module} -> {imported}")
    assert undocumented == [], "imports that docs/ARCHITECTURE.md's table of layers does not name"


def objects_in(value) -> list:
    """A parameter's value and what it holds (a tuple of classes, a dict of settings)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return [inner for item in value for inner in objects_in(item)]
    if isinstance(value, dict):
        return objects_in(list(value.values()))
    return [value]


def functions_of(value) -> list:
    """A function (unwrapped: a command's main is wrapped in common.errors.command), or a class's methods."""
    if isinstance(value, types.FunctionType):
        return [inspect.unwrap(value)]
    if not isinstance(value, type):
        return []
    found = []
    for attribute in vars(value).values():
        attribute = getattr(attribute, "__func__", getattr(attribute, "fget", attribute))
        if isinstance(attribute, types.FunctionType):
            found.append(inspect.unwrap(attribute))
    return found


def modules_named_by(item) -> set[str]:
    """The modules of mingpt a test uses, read from code: what its function, its parameters and the
    fixtures it asks for name (imported at the top of their file or inside them), through the tests' own
    functions and classes they call; and one module further, what the functions and classes of mingpt
    they name, and their module's own functions these call, name in turn (a test of plan.main uses
    planning/advice.py and planning/step_time.py)."""
    found, seen = set(), set()
    tests = str(REPO / "tests")

    def of_mingpt(value) -> Optional[str]:
        if isinstance(value, types.ModuleType):
            return value.__name__ if value.__name__.startswith("mingpt.") else None
        module = getattr(value, "__module__", None)
        return module if isinstance(module, str) and module.startswith("mingpt.") else None

    def visit(value, home: Optional[str]) -> None:
        """home: None for the tests' code; the module of the mingpt code that named value."""
        module = of_mingpt(value)
        if module:
            found.add(module)
            if home is None or module == home:
                for function in functions_of(value):
                    read(function.__code__, function.__globals__, module)
        elif home is None:
            for function in functions_of(value):
                if function.__code__.co_filename.startswith(tests):
                    read(function.__code__, function.__globals__, None)

    def read(code: types.CodeType, names: dict, home: Optional[str]) -> None:
        if (code, home) in seen:
            return
        seen.add((code, home))
        for name in code.co_names:
            if name.startswith("mingpt."):  # `from mingpt.x import y` inside a function
                found.add(name)
            value = names.get(name)
            if value is None and "mingpt" in code.co_names:  # `from mingpt import x` inside a function
                value = sys.modules.get(f"mingpt.{name}")
            if value is None:
                continue
            visit(value, home)
            if isinstance(value, types.ModuleType) and of_mingpt(value):  # `main.run(...)`
                for attribute in code.co_names:
                    if of_mingpt(getattr(value, attribute, None)):
                        visit(getattr(value, attribute), home)
        for inner in code.co_consts:
            if isinstance(inner, types.CodeType):  # nested functions, lambdas, comprehensions
                read(inner, names, home)

    visit(item.function, None)
    for value in objects_in(list(getattr(item, "callspec", SimpleNamespace(params={})).params.values())):
        visit(value, None)
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        for definition in definitions:
            visit(definition.func, None)
    return found


def test_the_quick_tier_touches_every_module(request):
    """`pytest -m "not slow"` (docs/testing.md) uses every module of mingpt: each is named by at least
    one test not marked slow."""
    tests = request.config.collected_tests  # conftest: every test collected, before -m or -k
    if {item.path for item in tests} != set((REPO / "tests").rglob("test_*.py")):
        pytest.skip("needs the whole suite collected: `pytest` or `pytest -m 'not slow'`")
    named = set().union(*(modules_named_by(item) for item in tests if not item.get_closest_marker("slow")))
    modules = {module_name(path, MINGPT).removesuffix(".__init__") for path in MINGPT.rglob("*.py")}
    unused = sorted(modules - named - {"mingpt"} - {f"mingpt.{name}" for name in LAYERS})
    assert unused == [], "modules no quick test uses: give each an in-process test not marked slow"


NOT_MIRRORED = {
    "test_layout.py": "the layout of the whole project: its layers, its imports, this rule",
    "test_landmarks.py": "the original example's names, wherever they went (docs/ARCHITECTURE.md)",
    "test_helpers.py": "the suite's own promise about its helpers (tests/helpers.py)",
    "storage/test_other_snapshots.py": "snapshots a run cannot resume, across the checkpointer and both "
                                       "stores",
    "storage/test_s3.py": "snapshots on a real S3 server, through every layer of storage/ to s3fs",
    "storage/test_saves_said.py": "what a run says of its saves, across the checkpointer, the stores and the "
                                  "watchdog",
    "planning/test_data_at_size.py": "the data of a run of 1,024 ranks (issue 56): the samplers and the "
                                     "check's shard reads at that size",
    "planning/test_sharded_at_size.py": "sharded snapshots across sizes (issue 56): 64 simulated ranks save, "
                                        "32 and 4 x 8 resume",
}
"""Test files that mirror no one module, each with why: they test a promise that spans modules, or one
module at a scale of its own. tests/end_to_end/ is named for behaviour throughout (whole runs)."""


def has_behaviour(path) -> bool:
    """A module with behaviour defines a function, or a class with a method (a property, a dataclass's
    __post_init__): what a test can call. Constants, re-exports and plain dataclasses are not."""
    tree = ast.parse(path.read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    return any(isinstance(node, functions) or isinstance(node, ast.ClassDef)
               and any(isinstance(inner, functions) for inner in node.body) for node in tree.body)


def imported_by(test) -> set[str]:
    """What a test file imports, as dotted names: `from mingpt.distributed import guard` gives
    mingpt.distributed and mingpt.distributed.guard."""
    found = set()
    for node in ast.walk(ast.parse(test.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def mirrors(test, module: str) -> bool:
    """test_<module>.py mirrors <module>.py (module: its dotted name, mingpt.storage.store); so does a
    second file of its tests, test_<module>_<what>.py, that imports it (test_fault_tolerance_ft.py),
    unless <module>_<what>.py is a module beside it."""
    package, name = module.rsplit(".", 1)
    if test.stem == f"test_{name}":
        return True
    # test_model_size.py is model_size.py's, though it starts with test_model_ and imports model.py
    sibling = MINGPT.parent.joinpath(*package.split("."), f"{test.stem.removeprefix('test_')}.py")
    imports_it = any(seen == module or seen.startswith(f"{module}.") for seen in imported_by(test))
    return test.stem.startswith(f"test_{name}_") and not sibling.exists() and imports_it


def modules_without_tests(mingpt, tests) -> list[str]:
    """mingpt/<package>/<module>.py with behaviour and no tests/<package>/test_<module>[_<what>].py."""
    found = []
    for path in sorted(mingpt.rglob("*.py")):
        folder = tests / path.parent.relative_to(mingpt)
        module = module_name(path, mingpt)
        if has_behaviour(path) and not any(mirrors(test, module) for test in folder.glob("test_*.py")):
            found.append(str(path.relative_to(mingpt.parent)))
    return found


def unnamed_test_files(mingpt, tests, bench) -> list[str]:
    """Test files whose name names no module beside them in mingpt/ (tests/bench/: in bench/, where a
    benchmark's code is a script of its own) and that NOT_MIRRORED does not list, tests/end_to_end/
    aside; and NOT_MIRRORED's entries that name no test file."""
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        name = str(path.relative_to(tests))
        if name.startswith("end_to_end/") or name in NOT_MIRRORED:
            continue
        if name.startswith("bench/"):
            scripts = [code for code in bench.glob("*") if code.suffix in (".py", ".sh")]
            named = any(path.stem == f"test_{code.stem}" for code in scripts)
        else:
            named = any(mirrors(path, module_name(code, mingpt))
                        for code in (mingpt / path.parent.relative_to(tests)).glob("*.py"))
        if not named:
            found.append(f"tests/{name}")
    return found + [f"tests/{name} (NOT_MIRRORED lists it: no such file)" for name in NOT_MIRRORED
                    if not (tests / name).exists()]


def test_every_module_with_behaviour_has_a_test_file_of_its_own():
    """docs/testing.md: the tests mirror the code. A module's tests are found where its name says."""
    missing = modules_without_tests(MINGPT, REPO / "tests")
    assert missing == [], ("give each a test file of its own, tests/<package>/test_<module>.py (or "
                           f"tests/test_<module>.py): {', '.join(missing)}")


def test_every_test_file_names_the_module_it_tests():
    unnamed = unnamed_test_files(MINGPT, REPO / "tests", REPO / "bench")
    assert unnamed == [], ("name each test file for its module (test_<module>.py), or list it in "
                           f"NOT_MIRRORED with why: {', '.join(unnamed)}")
