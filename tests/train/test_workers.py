"""Worker processes (`polyattn.train.workers`): none outlives a main process killed on its own."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import os, sys, time
from pathlib import Path
from polyattn.train.workers import in_processes

def job(folder):
    (Path(folder) / str(os.getpid())).touch()
    time.sleep(120)

if __name__ == "__main__":
    for _ in in_processes(job, [(sys.argv[1],)] * 2, 2):
        pass
"""


def alive(pid):
    """Running (not gone, not a zombie awaiting its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_exit_when_the_main_process_is_killed(tmp_path):
    (tmp_path / "main.py").write_text(SCRIPT)
    pids = tmp_path / "pids"
    pids.mkdir()
    main = subprocess.Popen([sys.executable, str(tmp_path / "main.py"), str(pids)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2 and main.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = [int(p.name) for p in pids.iterdir()]
    assert len(workers) == 2 and all(map(alive, workers))
    os.kill(main.pid, signal.SIGKILL)  # the main process alone, as a time limit may
    main.wait()
    deadline = time.monotonic() + 10
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    still = [pid for pid in workers if alive(pid)]
    for pid in still:  # on a failure, leave no process behind
        os.kill(pid, signal.SIGKILL)
    assert not still
