"""The layout's promises (docs/ARCHITECTURE.md): the packages stack in layers, the project imports as a
package, one module talks to fsspec, the snapshot format needs no FSDP, and the commands run as scripts
without shadowing anything."""
import ast
import importlib.metadata
import re
import subprocess
import sys

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


LAYERS = ("common", "model", "distributed", "tokens", "storage", "reporting", "planning")
"""mingpt's packages (and model.py) from the ground up, as docs/ARCHITECTURE.md draws them. The
original's files and the commands at the top of mingpt/ stand on all of them."""


def layer_of(module: str) -> int:
    """A module's layer: its package's (or model.py's) place in LAYERS; the top for the rest."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def project_imports(path) -> set[str]:
    """The mingpt modules a file imports (`from mingpt.storage import files` counts as
    mingpt.storage.files), read from its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("mingpt.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mingpt"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_each_package_imports_only_the_layers_below_it():
    upward = []
    for path in python_files("mingpt"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for imported in project_imports(path):
            if layer_of(imported) > layer_of(module):
                upward.append(f"{module} -> {imported}")
    assert upward == [], "imports that run up the layers of docs/ARCHITECTURE.md"
