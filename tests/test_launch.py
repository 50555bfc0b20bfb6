"""A multi-process launch that would silently run as one process is refused, with the command that works."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.launch import check_launch, requested_processes

REPO = Path(__file__).resolve().parents[1]
CPU_ENV = {"ACCELERATE_USE_CPU": "True", "OMP_NUM_THREADS": "1"}
LAUNCHER = [sys.executable, "/usr/bin/accelerate", "launch"]


def test_requested_processes_reads_flags_and_config_files(tmp_path):
    assert requested_processes([*LAUNCHER, "--num_processes", "2", "--cpu", "train.py", "a=1"]) == (2, True)
    assert requested_processes([*LAUNCHER, "--num-processes=4", "train.py"]) == (4, False)
    # the training script's own arguments are not the launcher's
    assert requested_processes([*LAUNCHER, "train.py", "--num_processes", "3", "--cpu"]) == (None, False)
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("use_cpu: true\nnum_processes: 3\n")
    assert requested_processes([*LAUNCHER, "--config_file", str(cfg), "train.py"]) == (3, True)
    assert requested_processes([*LAUNCHER, "--config_file", str(cfg), "--num_processes", "1", "train.py"]) == (1, True)
    assert requested_processes(["python", "train.py"]) == (None, False)


def test_check_launch_refuses_only_the_collapsed_case():
    argv = [*LAUNCHER, "--num_processes", "2", "--cpu", "train.py"]
    with pytest.raises(SystemExit, match=r"asked for 2 processes but started one.*OMP_NUM_THREADS=1.*"
                                         r"torchrun --nproc_per_node 2 train\.py"):
        check_launch(CPU_ENV, argv)
    check_launch({**CPU_ENV, "WORLD_SIZE": "2"}, argv)  # a real 2-process launch
    check_launch({}, argv)  # not accelerate's --cpu path
    check_launch(CPU_ENV, [*LAUNCHER, "--cpu", "train.py"])  # one process asked, one started
    check_launch(CPU_ENV, [*LAUNCHER, "--num_processes", "2", "train.py"])  # GPU launch: accelerate's own checks


def test_parent_argv_reads_the_launchers_command_line():
    code = "from flowgrpo.launch import parent_argv; print(parent_argv())"
    out = subprocess.run(["bash", "-c", f"{sys.executable} -c '{code}'; exit 0", "launcher-marker"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "launcher-marker" in out and "bash" in out, out


def test_accelerate_cpu_launch_with_two_processes_fails_before_any_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "train.py"), "debug=default",
         f"trainer.output_dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "asked for 2 processes but started one" in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


_ENDING = """
import atexit, logging, sys
from flowgrpo.launch import end_launched_process
atexit.register(lambda: open(sys.argv[1], "w").write("exit handlers ran"))
logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
logging.getLogger("run").info("the last line of the run")
sys.stdout.write("unflushed output")
end_launched_process()
print("after the end")  # a launched process never gets here
raise SystemExit(3)      # nor here (a single process does)
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_finished_launched_process_ends_at_once_with_its_handlers_run(tmp_path, world_size):
    """In a process of a multi-process launch, ``end_launched_process`` runs the exit and log handlers, flushes the
    output and exits 0 without returning (no interpreter teardown); in a single process it returns."""
    env = {**os.environ, "WORLD_SIZE": world_size, "PYTHONPATH": str(REPO)}
    marker, logfile = tmp_path / "atexit.txt", tmp_path / "run.log"
    proc = subprocess.run([sys.executable, "-c", _ENDING, str(marker), str(logfile)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert marker.read_text() == "exit handlers ran"
    assert "the last line of the run" in logfile.read_text()
    if world_size == "2":
        assert (proc.returncode, proc.stdout) == (0, "unflushed output"), proc.stderr
    else:
        assert proc.returncode == 3 and proc.stdout == "unflushed outputafter the end\n", proc.stderr
