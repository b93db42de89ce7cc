"""A real SLURM for the tests: Debian's slurmctld and slurmd, configured for this host in a
temporary folder, started once per test session and stopped at its end.

The configuration is the smallest that runs here (a container): one node (this host, its
CPUs), one partition `debug`, `auth/none` and `cred/none` instead of munge (no key to make),
`proctrack/linuxproc` and `task/none` (no cgroup plugins), credentials that expire after 5 s
instead of 120 (a requeued job waits that long before it starts again), a scheduler that looks
at pending jobs every second (not 60), no accounting (a job's state is read
with `scontrol` while SLURM remembers it). Its own ports, so a SLURM already on the machine is
left alone. The tests skip where slurmctld is not installed, unless DIFFTUNE_REQUIRE_SLURM=1
(CI installs Debian's slurm-wlm and sets it), where they fail.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

PARTITION = "debug"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(root: Path, host: str) -> str:
    """slurm.conf for one node, this host."""
    user = getpass.getuser()
    return f"""ClusterName=difftunetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
MpiDefault=none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _wait_idle(deadline: float, procs: list[subprocess.Popen], root: Path) -> None:
    """Until the node takes jobs; the daemons' logs in the failure otherwise."""
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        if state.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text()[-2000:] for p in root.glob("*.log"))
    pytest.fail(f"the test SLURM did not start:\n{logs}")


def _cancel_all(deadline: float) -> None:
    """Cancel the session's jobs and wait until SLURM has ended them (their processes with
    them), so no training outlives the test SLURM."""
    subprocess.run(["scancel", "--full", "-u", getpass.getuser()], capture_output=True)
    while time.monotonic() < deadline:
        left = subprocess.run(["squeue", "-h"], capture_output=True, text=True)
        if left.returncode != 0 or not left.stdout.strip():
            return
        time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A running one-node SLURM (SLURM_CONF set for this process and its children); the
    folder of its configuration and logs."""
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None:
        if os.environ.get("DIFFTUNE_REQUIRE_SLURM") == "1":
            pytest.fail("DIFFTUNE_REQUIRE_SLURM=1 but slurmctld/slurmd are not installed "
                        "(apt-get install slurm-wlm)")
        pytest.skip("SLURM (slurmctld, slurmd) is not installed")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, socket.gethostname().split(".")[0]))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    procs = [subprocess.Popen([daemon, "-D", "-f", str(conf)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT) for daemon in ("slurmctld", "slurmd")]
    try:
        _wait_idle(time.monotonic() + 60, procs, root)
        yield root
    finally:
        _cancel_all(time.monotonic() + 30)
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
