"""Stand-in for ``srun`` inside an allocation, for an engine's ranks on "other nodes" that are
processes of this machine (tests/test_server_ranks.py puts it first on PATH as ``srun``).

    fake_srun.py --nodes=K --ntasks=K --ntasks-per-node=1 --relative=1 --kill-on-bad-exit=1 --label ... CMD...

What srun does that the engine relies on: it runs ``--ntasks`` copies of CMD, task i with
``SLURM_PROCID=i``, ``SLURM_NODEID=i`` and ``SLURMD_NODENAME=<FAKE_SRUN_NODE_PREFIX><relative+i>``
(default ``fakenode``); with ``--label`` each output line starts ``i: ``; with
``--kill-on-bad-exit=1`` a task that exits non-zero ends the others and srun exits with its
code after ``srun: error: NODE: task i: Exited with exit code RC``; SIGTERM (or SIGINT) is passed
to every task, then srun exits. It refuses (exit 1) what real srun would get wrong: no
``SLURM_JOB_ID`` (not in an allocation), or the shard step's ``SLURM_STEP_ID`` inherited (its
one-task step's settings would leak in). Its pid and each task's are printed (``fake srun: pid P``, ``fake srun: task i pid P``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        key, _, value = argv[i].lstrip("-").partition("=")
        options[key] = value or "1"
        i += 1
    return options, argv[i:]


def main() -> None:
    options, command = _options(sys.argv[1:])
    print(f"fake srun: {' '.join(sys.argv[1:])}", flush=True)
    print(f"fake srun: pid {os.getpid()}", flush=True)
    if not os.environ.get("SLURM_JOB_ID"):
        sys.exit("srun: error: no allocation (SLURM_JOB_ID unset)")
    if "SLURM_STEP_ID" in os.environ:
        sys.exit("srun: error: fake srun: the shard step's SLURM_STEP_ID was inherited")
    ntasks, relative = int(options.get("ntasks", "1")), int(options.get("relative", "0"))
    prefix = os.environ.get("FAKE_SRUN_NODE_PREFIX", "fakenode")
    tasks = []
    for i in range(ntasks):
        env = {**os.environ, "SLURM_PROCID": str(i), "SLURM_NODEID": str(i), "SLURMD_NODENAME": f"{prefix}{relative + i}"}
        task = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"fake srun: task {i} pid {task.pid}", flush=True)
        tasks.append(task)
        threading.Thread(target=_relay, args=(task, f"{i}: " if "label" in options else ""), daemon=True).start()

    def stop(signum, frame):
        _signal_all(tasks, signal.SIGTERM)
        _wait_all(tasks)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        for i, task in enumerate(tasks):
            rc = task.poll()
            if rc not in (None, 0) and options.get("kill-on-bad-exit") == "1":
                print(f"srun: error: {prefix}{relative + i}: task {i}: Exited with exit code {rc}", flush=True)
                _signal_all(tasks, signal.SIGTERM)
                _wait_all(tasks)
                sys.exit(rc)
        if all(t.poll() is not None for t in tasks):
            sys.exit(max(t.returncode for t in tasks))
        time.sleep(0.05)


def _relay(task: subprocess.Popen, label: str) -> None:
    for line in task.stdout:
        sys.stdout.write(label + line.decode("utf-8", "replace"))
        sys.stdout.flush()


def _signal_all(tasks: list, sig: int) -> None:
    for task in tasks:
        if task.poll() is None:
            try:
                os.killpg(task.pid, sig)
            except ProcessLookupError:
                pass


def _wait_all(tasks: list, grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    for task in tasks:
        try:
            task.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal_all(tasks, signal.SIGKILL)


if __name__ == "__main__":
    main()
