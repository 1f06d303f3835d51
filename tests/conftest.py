"""Fixtures shared by the tests (helpers.py holds the plain functions)."""
import json
import os
import shutil
import signal
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import psutil
import pytest
from filelock import FileLock
from helpers import (
    MINGPT,
    REPO,
    TORCHRUN,
    WORKER_SCRIPTS,
    assert_ok,
    kill_all,
    make_text,
    run,
    run_main,
    tiny_overrides,
)
from s3_server import S3Server, start_s3_server

from mingpt.common.files import CACHE_DIR_ENV


def pytest_configure(config):
    """The suite's own cache folder (token files, step traces, the CPU's peaks), fresh for each run
    and shared by its workers and every process they start: never the user's ~/.cache, nor one a
    user set. The workers (pytest-xdist) inherit it from the run that starts them."""
    if not hasattr(config, "workerinput"):
        config.suite_cache = tempfile.mkdtemp(prefix="mingpt-suite-cache-")
        os.environ[CACHE_DIR_ENV] = config.suite_cache


LONGEST_FIRST = ("end_to_end/test_cluster.py", "end_to_end/test_exact_resume.py", "bench/test_bench_ft.py",
                 "end_to_end/test_fault_tolerant_runs.py", "end_to_end/test_hangs.py", "test_main.py",
                 "storage/test_sharded_store.py", "distributed/test_parallel.py",
                 "distributed/test_precision.py")
"""The files that take longest, started first: begun last, one would keep a worker busy after the
others have finished."""


SLOW_FIXTURES = {"ddp_two_epochs", "fsdp_two_epochs", "s3"}
"""Session fixtures that start runs (or a server) the quick tier goes without: a test that asks for one
is slow. The quick tier keeps two: tiny_epoch (`python main.py`, one process) and probe_runs (one
torchrun launch of 2 ranks, every probe of tests/workers)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` and `-k` deselect
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    config.collected_tests = list(items)  # the whole suite's, for test_layout's quick-tier test

    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(f"tests/{name}")),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: each file keeps its own order


def pytest_unconfigure(config):
    if hasattr(config, "suite_cache"):
        shutil.rmtree(config.suite_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A 6,000-character generated text, so that tests run anywhere."""
    path = tmp_path_factory.mktemp("data") / "input.txt"
    path.write_text(make_text(6000))
    return path


def once_per_suite(request, tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder that make(folder) fills once for the whole suite: pytest-xdist runs a session fixture
    once per worker, so the first worker to ask makes it (under a lock) and the others wait for it."""
    if not hasattr(request.config, "workerinput"):  # no xdist: this session is the suite
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    folder = tmp_path_factory.getbasetemp().parent / name  # the session's folder, beside each worker's
    with FileLock(f"{folder}.lock"):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed half-way
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def shared_text(request, tmp_path_factory) -> Path:
    """The text of the runs made once per suite (text_file's twin, in a folder every worker sees)."""
    return once_per_suite(request, tmp_path_factory, "shared_text",
                          lambda folder: (folder / "input.txt").write_text(make_text(6000))) / "input.txt"


@pytest.fixture(scope="session")
def tiny_epoch(request, shared_text, tmp_path_factory) -> SimpleNamespace:
    """One epoch of the tiny model in one process, run as a user inside mingpt/ runs it (`python
    main.py`). The tests that need just a trained snapshot share this run (tiny_epoch.snapshot);
    one that alters the snapshot alters a copy."""
    def make(folder: Path) -> None:
        result = run_main(tiny_overrides(shared_text, folder / "snap.pt"), cwd=MINGPT, script="main.py")
        assert_ok(result)
        (folder / "stdout.txt").write_text(result.stdout)

    folder = once_per_suite(request, tmp_path_factory, "tiny_epoch", make)
    return SimpleNamespace(stdout=(folder / "stdout.txt").read_text(), snapshot=folder / "snap.pt")


def two_epochs_on_two_ranks(request, tmp_path_factory, name: str, text: Path, cwd: Path, script: Path,
                            **extra) -> SimpleNamespace:
    """`torchrun --standalone --nproc_per_node=2 <script>` from cwd, made once per suite: two epochs of
    the tiny model, a snapshot after each (in a folder: both kept). Its output (.stdout, .stderr,
    .returncode), its snapshot folder and snapshots, oldest first."""
    def make(folder: Path) -> None:
        overrides = tiny_overrides(text, folder / "snaps", trainer_config__max_epochs=2, **extra)
        result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", script, *overrides], cwd=cwd)
        assert_ok(result)
        for stream in ("stdout", "stderr"):
            (folder / f"{stream}.txt").write_text(getattr(result, stream))

    folder = once_per_suite(request, tmp_path_factory, name, make)
    snapshots = folder / "snaps"
    output = {stream: (folder / f"{stream}.txt").read_text() for stream in ("stdout", "stderr")}
    return SimpleNamespace(folder=snapshots, snapshots=sorted(snapshots.glob("snapshot_*.pt")), returncode=0,
                           **output)


@pytest.fixture(scope="session")
def ddp_two_epochs(request, shared_text, tmp_path_factory) -> SimpleNamespace:
    """DDP from the repository root (`mingpt/main.py`), progress lines every 0.5 s: the unbroken run
    that fault-tolerance and cross-method tests compare with, and test_distributed's run from the root."""
    return two_epochs_on_two_ranks(request, tmp_path_factory, "ddp_two_epochs", shared_text, REPO,
                                   MINGPT / "main.py", trainer_config__progress_interval_s=0.5)


@pytest.fixture(scope="session")
def fsdp_two_epochs(request, shared_text, tmp_path_factory) -> SimpleNamespace:
    """FSDP from inside mingpt/ (`main.py`): test_parallel's FSDP reference and test_distributed's run
    from inside mingpt/."""
    return two_epochs_on_two_ranks(request, tmp_path_factory, "fsdp_two_epochs", shared_text, MINGPT,
                                   Path("main.py"), trainer_config__distributed_method="fsdp")


@pytest.fixture(scope="session")
def probe_runs(request, shared_text, tmp_path_factory) -> Path:
    """tests/workers/probes.py on 2 ranks, once per suite: every probe of tests/workers in one launch,
    each into a folder of its own (init, steps, grad_sync: see that script)."""
    def make(folder: Path) -> None:
        assert_ok(run([*TORCHRUN, "--standalone", "--nproc_per_node=2", WORKER_SCRIPTS / "probes.py",
                       shared_text, folder]))

    return once_per_suite(request, tmp_path_factory, "probes", make)


@pytest.fixture(scope="session")
def probes(probe_runs) -> dict[str, list[dict]]:
    """What each of 2 ranks saw of one step, an eval pass and a snapshot, DDP then FSDP in one run
    (tests/workers/probe.py: test_distributed's DDP facts, test_parallel's FSDP ones)."""
    return {method: [json.loads((probe_runs / "steps" / f"{method}_rank{rank}.json").read_text())
                     for rank in range(2)]
            for method in ("ddp", "fsdp")}


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> S3Server:
    """A real S3 server (moto) on loopback with a bucket and one user; stopped after the tests."""
    server, process = start_s3_server(tmp_path_factory.mktemp("s3") / "moto.log")
    yield server
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def world_of_one():
    """An in-process process group of one (as `python main.py` makes), for code that gathers state
    through torch.distributed; the fixture's value is its DistEnv."""
    import torch.distributed as dist

    from mingpt.distributed.process_group import init_distributed

    yield init_distributed()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny in-process models run faster on one thread than on two contended ones."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


GUARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Every process a test started and left running (a worker of a failed or timed-out run, a server
    of its own) is killed when the test ends; those of wider fixtures were there before it began.
    Signal handlers a test changed in this process are put back (its children would inherit them:
    an ignored SIGINT makes Ctrl-C tests of later tests hang), with a warning naming the test."""
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    handlers = {number: signal.getsignal(number) for number in GUARDED_SIGNALS}
    yield
    for number, handler in handlers.items():
        if signal.getsignal(number) != handler:
            signal.signal(number, handler)
            warnings.warn(f"the test changed the {signal.Signals(number).name} handler; put back")
    kill_all([child for child in me.children(recursive=True) if child.pid not in before])
