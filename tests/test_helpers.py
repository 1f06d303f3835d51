"""The suite's own promise: a command that outlives its time dies with every process it started."""
import subprocess
import sys
import time

import psutil
import pytest
from helpers import run

pytestmark = pytest.mark.slow

PARENT_OF_A_SLEEPER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "pid"
    script = PARENT_OF_A_SLEEPER.replace("print(child.pid, flush=True)",
                                         f"open({str(pid_file)!r}, 'w').write(str(child.pid))")
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, "-c", script], timeout=3)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the command's child outlived it"
        time.sleep(0.05)
