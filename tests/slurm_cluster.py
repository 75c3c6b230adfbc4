"""A real two-node SLURM cluster on this machine, for the tests of the sbatch examples.

Debian's ``slurm-wlm`` 22.05 daemons with ``munge``: one ``slurmctld`` and two ``slurmd -N n1``,
``slurmd -N n2`` on 127.0.0.1, each its own node of partition ``debug``; ``srun -N2`` starts one
task on each. The packages are installed with apt where missing (root only; nothing is called
where they are there already). Everything else lives in one temporary folder: configuration,
munge key and socket, state, spool, logs. :meth:`SlurmCluster.stop` ends the daemons and every
process of the cluster's jobs, found by the ``SLURM_CONF`` they all carry.

Why the configuration looks as it does:

- munged runs with a key and a socket of its own (``AuthInfo=socket=...``): a munged of the
  machine, if any, is neither needed nor touched.
- The node names n1 and n2 must resolve (srun and slurmstepd look them up, and so does
  ``ckptavg merge``: rank 0's address is the first node of ``SLURM_STEP_NODELIST``), so
  ``127.0.0.1 n1 n2`` goes into /etc/hosts where they do not.
- ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``: the daemons listen on their node
  address, 127.0.0.1, not on every interface. Ports are free ones picked at start, and
  ``FirstJobId`` random, so that clusters of test sessions running side by side on one machine
  share no port, and most likely no job id either (``ckptavg merge`` under srun derives its
  rendezvous port from the job id).
- ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
  ``JobAcctGatherType=jobacct_gather/none``: no cgroups. Slurm's cgroups are machine-wide and
  named by job id (``/slurm/uid_0/job_N``), so two clusters on one machine would collide there;
  linuxproc finds a job's processes by parentage, which is enough for processes that do not
  daemonize.
- ``SlurmdParameters=config_overrides``: each node claims 8 CPUs on whatever the machine has,
  so that the tests' jobs (one CPU per node each) run side by side.
- ``JobRequeue=0``, as many sites set it: a job goes back to the queue (preemption, ``scontrol
  requeue``) only if it asks, as the examples do (``#SBATCH --requeue``).
- No accounting storage (slurmdbd): ``sacct`` has nothing; job states come from ``scontrol show
  job``, which keeps ended jobs for ``MinJobAge`` (an hour).
- SLURM holds a requeued batch job about two minutes (reason ``BeginTime``) before it may start
  again; :meth:`SlurmCluster.release` starts it within a second (``scontrol update
  StartTime=now``, in a later second than the end of the job's last run: see there).
- ``KillWait=5``: SIGKILL 5 s after the SIGTERM that ends or requeues a job (30 s by default).
- ``SchedulerParameters=sched_interval=1``: pending jobs are looked at every second (60 s by
  default), so a released job starts within a second or so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
NODES = ("n1", "n2")
# Job states after which a run of a job is over (a requeued job goes on under the same id).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
# Held while packages are installed or /etc/hosts is edited: test sessions side by side.
_MACHINE_LOCK = Path("/tmp/ckptavg-slurm-setup.lock")


def _program(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{_SBIN}")


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    with open(_MACHINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def unavailable() -> str | None:
    """Why no cluster can be had here, or None once SLURM and munge are installed and the node
    names resolve to 127.0.0.1 (installing and adding them to /etc/hosts where needed)."""
    missing = [p for p in PROGRAMS if not _program(p)]
    if not missing and _nodes_resolve():
        return None
    need = f"SLURM is not installed (no {', '.join(missing)})" if missing else f"{', '.join(NODES)} do not resolve"
    if os.geteuid() != 0:
        return f"{need}, and setting that up needs root"
    if missing and _program("apt-get") is None:
        return f"{need}, and no apt-get to install {' '.join(PACKAGES)}"
    with _machine_lock():
        if not all(_program(p) for p in PROGRAMS):
            failure = _apt_install()
            if failure:
                return failure
        if not _nodes_resolve():
            with open("/etc/hosts", "a") as hosts:
                hosts.write(f"127.0.0.1 {' '.join(NODES)}  # ckptavg's SLURM tests\n")
    return None if _nodes_resolve() else f"the node names {', '.join(NODES)} do not resolve to 127.0.0.1"


def _nodes_resolve() -> bool:
    try:
        return all(socket.gethostbyname(node) == "127.0.0.1" for node in NODES)
    except OSError:
        return False


def _apt_install() -> str | None:
    """Install :data:`PACKAGES` (without recommends: 8 packages instead of 43); the package lists
    are fetched only when the packages cannot be found without them. None, or why it failed."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300"]
    result = subprocess.run([*install, *PACKAGES], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True)
        result = subprocess.run([*install, *PACKAGES], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {result.stderr.strip().splitlines()[-1:]}"
    return None


def _free_port() -> int:
    """A port nothing listens on, outside 20000-39999 (where ``ckptavg merge`` under srun puts its
    rendezvous)."""
    while True:
        port = random.randrange(40000, 60000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class SlurmCluster:
    """slurmctld and two slurmd on loopback, configured in ``root``; :meth:`start`, :meth:`stop`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM command needs in its environment to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        for sub in ("munge", "state", "log", *(f"spool-{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge, log = self.root / "munge", self.root / "log"
        (munge / "key").write_bytes(os.urandom(1024))
        (munge / "key").chmod(0o400)
        self._write_conf()
        self._daemon(
            "munged", "--foreground", "--force", f"--socket={munge / 'socket'}", f"--key-file={munge / 'key'}",
            f"--pid-file={munge / 'pid'}", f"--log-file={log / 'munged.log'}", f"--seed-file={munge / 'seed'}",
        )  # fmt: skip
        self._wait(lambda: (munge / "socket").exists(), "munged to create its socket")
        self._daemon("slurmctld", "-D", "-i")
        for node in NODES:
            self._daemon("slurmd", "-D", "-N", node)
        self._wait(self._nodes_idle, "both nodes to be idle in sinfo")

    def _write_conf(self) -> None:
        root, munge_socket = self.root, self.root / "munge" / "socket"
        nodes = "\n".join(
            f"NodeName={node} NodeAddr=127.0.0.1 Port={_free_port()} CPUs=8 RealMemory=2000 State=UNKNOWN"
            for node in NODES
        )
        self.conf.write_text(
            f"""\
ClusterName=ckptavg
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool-%n"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd-%n.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd-%n.log"}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=0
SchedulerParameters=sched_interval=1
FirstJobId={random.randrange(1000, 1_000_000)}
MinJobAge=3600
KillWait=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _daemon(self, program: str, *args: str) -> None:
        path = _program(program)
        assert path is not None, f"{program} is not installed"
        log = open(self.root / "log" / f"{program}-{len(self.daemons)}.out", "wb")  # noqa: SIM115 - kept open
        self.daemons.append(
            subprocess.Popen([path, *args], env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT)
        )
        log.close()  # the daemon holds its own copy

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float = 60) -> None:
        """Poll until the cluster is ``ready``; else fail with the end of every daemon's log."""
        deadline = time.monotonic() + timeout
        while not ready():
            ended = [d.args[0] for d in self.daemons if d.poll() is not None]
            if ended or time.monotonic() > deadline:
                logs = sorted((self.root / "log").iterdir())
                shown = "\n".join(f"{p.name}: {p.read_text(errors='replace')[-2000:]}" for p in logs)
                raise RuntimeError(f"SLURM test cluster: gave up waiting for {what} (ended: {ended}):\n{shown}")
            time.sleep(0.1)

    def _nodes_idle(self) -> bool:
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        return sorted(result.stdout.split()) == sorted([*NODES, "idle", "idle"])

    def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster."""
        result = subprocess.run(
            command, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60, **kwargs
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed: {result.stderr.strip()}")
        return result

    def stop(self) -> None:
        """End every job, then the daemons, then any process of this cluster left behind.

        The jobs first: slurmd and slurmctld told to stop while a job is still being ended wait
        about 30 s each; with no job left they stop at once."""
        with contextlib.suppress(Exception):  # a cluster that never started has nothing to cancel
            self.run("scancel", "--full", "--partition=debug", check=False)
            deadline = time.monotonic() + 30
            while self.run("squeue", "--noheader", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for daemon in reversed(self.daemons):
            daemon.terminate()
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in self._processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _processes(self) -> list[int]:
        """Processes started with this cluster's ``SLURM_CONF`` (slurmstepd, job scripts, tasks)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
        return found

    # -- jobs ------------------------------------------------------------------------------------

    def sbatch(self, *args: str, env: dict[str, str], cwd: Path) -> int:
        """Submit a batch job with this environment (``--export=ALL``); its id."""
        result = subprocess.run(
            ["sbatch", "--parsable", "--export=ALL", *args],
            env={**env, **self.env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, f"sbatch {' '.join(args)} failed: {result.stderr}"
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of a job (JobState, Restarts, ExitCode, NodeList, ...)."""
        shown = self.run("scontrol", "--oneliner", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def wait(self, job_id: int, until: Callable[[dict[str, str]], bool], what: str, timeout: float = 180) -> dict:
        """Poll the job's state until ``until`` holds for it; its fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            assert time.monotonic() < deadline, f"job {job_id}: gave up waiting for {what}: {fields}"
            time.sleep(0.2)

    def ended(self, job_id: int, run: int = 0) -> dict[str, str]:
        """Wait for run ``run`` (0: the first; each requeue adds one) of a job to end; its fields."""

        def over(fields: dict[str, str]) -> bool:
            assert int(fields["Restarts"]) <= run, f"job {job_id} was requeued more than {run} times: {fields}"
            return int(fields["Restarts"]) == run and fields["JobState"] in ENDED

        return self.wait(job_id, over, f"run {run} to end")

    def release(self, job_id: int, run: int) -> None:
        """Wait until the job is back in the queue for run ``run``, then let it start at once."""

        def queued(fields: dict[str, str]) -> bool:
            again = int(fields["Restarts"]) == run
            assert again or fields["JobState"] not in ENDED, f"job {job_id} ended, not requeued: {fields}"
            return again and fields["JobState"] == "PENDING"

        self.wait(job_id, queued, f"it to be requeued for run {run}")
        # The nodes revoked the job's credential when its last run ended, and slurmd refuses a
        # credential made in the same second as that ("Job credential revoked"): start the next
        # run in a later second (SLURM's own hold is two minutes).
        later = int(time.time()) + 1
        while time.time() < later:
            time.sleep(later - time.time())
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
