import sys

import pytest
import torch

import launch
from helpers import MINGPT, run, tiny_overrides
from test_distributed import check_two_rank_run


def test_worker_count_defaults_to_gpus_or_two_cpu_workers():
    assert launch.worker_count(3) == 3
    assert launch.worker_count(None) == (torch.cuda.device_count() or 2)


def test_launch_starts_cpu_workers_through_the_elastic_launcher(text_file, tmp_path):
    snapshot = tmp_path / "snap.pt"
    result = run([sys.executable, MINGPT / "launch.py", "--nproc", "2", *tiny_overrides(text_file, snapshot)])
    check_two_rank_run(result, snapshot)


def test_launch_reports_failed_workers(text_file, tmp_path):
    result = run([sys.executable, MINGPT / "launch.py", "--nproc", "2",
                  *tiny_overrides(text_file, tmp_path / "snap.pt"), "trainer_config.batch_size=0"])
    assert result.returncode == 1
    assert result.stderr.count("error: trainer_config.batch_size: must be positive") == 1
    assert "error: training failed on rank" in result.stderr


def test_bad_nproc_is_refused():
    with pytest.raises(SystemExit):
        launch.main(["--nproc", "0"])
