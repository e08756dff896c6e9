"""MPI scripts (``code.framework`` ``mpi``): the ranks of a script that brings its own MPI — mpi4py,
Horovod over MPI — start under Open MPI's ``mpirun``, from the image's own MPI (docs/user-code.md "MPI").

    python -m trainer_pkg.launch --config job.json --standalone --nproc-per-node 2
        # one machine: mpirun -np 2 --oversubscribe --bind-to none --map-by slot \\
        #     python -m trainer_pkg.frameworks.mpi train.py ARGS
    mpirun -np 2 python -m trainer_pkg.launch --config job.json
        # a platform's mpirun started the ranks (SageMaker's and Azure ML's ``mpi`` distributions):
        # each launcher runs the script as its rank

Who starts the ranks (:func:`run`, called by :func:`trainer_pkg.launch.run_framework`):

- **the platform's mpirun** (``OMPI_COMM_WORLD_RANK`` set in this launcher's environment: SageMaker's
  ``mpi`` distribution, Azure ML's ``MpiDistribution``, or a person's own ``mpirun``): this launcher
  is one rank; it runs the script as a child that inherits the rank's MPI identity (Open MPI lets
  the child's ``MPI_Init`` take the rank: checked with SageMaker's ``python -m mpi4py`` entry, which
  initialises MPI before our entry script replaces itself with the launcher);
- **our mpirun** where the platform has no MPI launcher: on one node (a GPU box, one Slurm node,
  Kubernetes or Vertex with one node) ``mpirun -np nproc`` on this machine; on Slurm with several
  nodes, node 0's launcher runs ``mpirun --host n1:P,n2:P -np nodes×P`` and Open MPI's Slurm launcher
  starts its daemons on the nodes with ``srun`` inside the allocation (``SLURM_OVERLAP=1``: that step
  shares the CPUs our own step holds; ``SLURM_EXPORT_ENV=ALL``: it passes the environment on); the
  launchers of the other nodes log that and exit 0.
  ``srun --mpi=pmix`` is not used: Slurm's PMIx plugin of Debian's Slurm 22.05 fails when two
  slurmd share a host (both create ``/tmp/spmix_appdir_<uid>_<job>.<step>``), which is how the test
  cluster runs, while mpirun works on it and on real clusters alike.

Several nodes of Kubernetes or Vertex have no MPI launcher (mpirun would need ssh between the pods):
refused with a message. Ranks that torchrun or the platform started without MPI (``RANK`` set, no
``OMPI_COMM_WORLD_RANK``) are refused too: they cannot form one MPI world.

What each rank gets, besides Trainboard's variables (``TRAINBOARD_*``, :func:`trainer_pkg.launch.trainboard_env`):
Open MPI's own ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``; from them, set by
:func:`rank_variables` before the script's first line, torchrun's ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (so :mod:`trainer_pkg.report` logs from rank 0
only) and Horovod's ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
``HOROVOD_CROSS_RANK`` (node), ``HOROVOD_CROSS_SIZE`` (nodes) as ``horovodrun`` sets them (Horovod over
MPI reads MPI itself and ignores them: they only read Gloo); ``MASTER_ADDR``/``MASTER_PORT`` where
there is one (127.0.0.1 and a free port on one node, the plan's master on Slurm and SageMaker), for
a script that also opens a torch process group.

Stopping: SIGTERM/SIGINT to the launcher go to mpirun, which passes them to every rank and kills what
is left; a rank the platform's mpirun started is stopped by that mpirun (the script runs in the
launcher's process group, which Open MPI signals).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Mapping

from trainer_pkg.config import ConfigError, JobConfig
from trainer_pkg.hang import HANG_DIR
from trainer_pkg.launch import (
    _RANK_VARS,
    _SCRIPT_ENTRY,
    UserScript,
    _free_port,
    _node_sampler,
    _script_pythonpath,
    _supervise,
    _with_trainboard_env,
    trainboard_env,
    watch_for_hangs,
)
from trainer_pkg.metrics import print_line
from trainer_pkg.platforms import (
    LAUNCHED_BY_US,
    LaunchPlan,
    MpiWorld,
    PlatformError,
    cpu_threads_per_rank,
    expand_nodelist,
    read_mpi_world,
)

MPIRUN = "mpirun"
"""Open MPI's launcher, found on the ranks' ``PATH`` (the image's own MPI)."""
RANK_ENTRY = ("-m", "trainer_pkg.frameworks.mpi")
"""What mpirun runs in each rank: this module sets the rank's variables, then runs the script as
:mod:`trainer_pkg.rank_entry` does."""
HOROVOD_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def rank_variables(world: MpiWorld) -> dict[str, str]:
    """torchrun's and Horovod's variables for the rank ``world`` describes (module docstring)."""
    values = {"RANK": world.rank, "WORLD_SIZE": world.size, "LOCAL_RANK": world.local_rank,
              "LOCAL_WORLD_SIZE": world.local_size, "GROUP_RANK": world.node_rank,
              "HOROVOD_RANK": world.rank, "HOROVOD_SIZE": world.size, "HOROVOD_LOCAL_RANK": world.local_rank,
              "HOROVOD_LOCAL_SIZE": world.local_size, "HOROVOD_CROSS_RANK": world.node_rank,
              "HOROVOD_CROSS_SIZE": world.nodes}
    return {name: str(value) for name, value in values.items()}


def mpirun_command(plan: LaunchPlan, script: UserScript, *, python: str = sys.executable,
                   hosts: tuple[str, ...] = (), exported: tuple[str, ...] = (),
                   as_root: bool | None = None) -> list[str]:
    """The ``mpirun`` argument list that starts ``plan``'s ranks, each running ``script`` under
    :data:`RANK_ENTRY`: ``-np`` the world size; with ``hosts`` (several nodes) ``--host
    h:nproc,...``; ``--map-by slot`` (ranks fill the nodes in order, as :class:`MpiWorld` counts
    them), ``--bind-to none`` (the job shares the machine: Open MPI's default binds the ranks to the
    first cores), ``--oversubscribe`` (the dashboard decided the processes per node; Open MPI would
    refuse more ranks than the cores it counts), ``-x NAME`` for each of ``exported`` (the
    variables the launcher set, so the ranks of other nodes get them too) and
    ``--allow-run-as-root`` when this process runs as root (``as_root`` None: ``os.geteuid() == 0``;
    Open MPI refuses root without it)."""
    cmd = [MPIRUN, "-np", str(plan.world_size)]
    if hosts:
        cmd += ["--host", ",".join(f"{host}:{plan.nproc_per_node}" for host in hosts)]
    cmd += ["--map-by", "slot", "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0 if as_root is None else as_root:
        cmd.append("--allow-run-as-root")
    for name in exported:
        cmd += ["-x", name]
    return cmd + [python, *RANK_ENTRY, *script.argv()]


def node_command(config_path: str, plan: LaunchPlan, *, python: str = sys.executable) -> list[str]:
    """What a backend that starts one process per node itself (the GPU box, where torchrun would
    otherwise start the ranks) runs on this node for an MPI script: this launcher, once, with the
    node's processes; it starts them with mpirun."""
    return [python, "-m", "trainer_pkg.launch", "--config", config_path, "--standalone",
            "--nproc-per-node", str(plan.nproc_per_node)]


def run(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hardware_every_s: float = 0.0) -> int:
    """Start or be the ranks of ``script`` (module docstring) and wait; the exit code this node
    reports. Raises :class:`ConfigError` (exit code 2, the message in the job's log) when the ranks
    cannot be started here: no Open MPI ``mpirun``, several nodes without an MPI launcher, or ranks
    another launcher started without MPI."""
    try:
        world = read_mpi_world(os.environ)
    except PlatformError as exc:
        raise ConfigError(str(exc)) from None
    if world is not None:
        return run_rank_here(cfg, plan, world, script, hardware_every_s=hardware_every_s)
    if plan.in_process:
        raise ConfigError(
            f"code.framework mpi: this process is rank {os.environ.get('RANK', '?')} of ranks that "
            f"{plan.platform} started without MPI (RANK is set, OMPI_COMM_WORLD_RANK is not); an MPI "
            "script's ranks are started by mpirun: run the launcher once per node "
            "(python -m trainer_pkg.launch --standalone), or under the platform's mpi distribution")
    hosts: tuple[str, ...] = ()
    if plan.nnodes > 1:
        hosts = _slurm_hosts(plan)
        if plan.node_rank != 0:
            print_line(f"[launch] mpi: node 0's mpirun starts the {plan.nproc_per_node} rank(s) of node_rank "
                       f"{plan.node_rank} (Open MPI's Slurm launcher); nothing to start here")
            return 0
    return run_mpirun(cfg, plan, script, hosts=hosts, hardware_every_s=hardware_every_s)


def _slurm_hosts(plan: LaunchPlan) -> tuple[str, ...]:
    """The hosts of a Slurm allocation, in node order; :class:`ConfigError` on another platform."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "").strip()
    if plan.platform != "slurm" or not nodelist:
        raise ConfigError(
            f"code.framework mpi: {plan.nnodes} nodes on {plan.platform}, which has no MPI launcher "
            "(mpirun would need ssh between the nodes); run an MPI script on one node there, or on "
            "Slurm, SageMaker or Azure ML, whose MPI starts the ranks on every node")
    try:
        hosts = tuple(expand_nodelist(nodelist))
    except ValueError as exc:
        raise ConfigError(f"Slurm: SLURM_JOB_NODELIST cannot be read: {exc}") from None
    if len(hosts) != plan.nnodes:
        raise ConfigError(f"Slurm: SLURM_JOB_NODELIST names {len(hosts)} host(s), the plan {plan.nnodes} node(s)")
    return hosts


def _open_mpi(env: Mapping[str, str]) -> str:
    """The path of the ranks' ``mpirun``, checked to be Open MPI's; :class:`ConfigError` saying what
    to install otherwise (the flags above are Open MPI's)."""
    path = shutil.which(MPIRUN, path=env.get("PATH"))
    if path is None:
        raise ConfigError("code.framework mpi: no mpirun on PATH; the image must bring Open MPI "
                          "(Debian: apt-get install openmpi-bin libopenmpi-dev)")
    try:
        version = subprocess.run([path, "--version"], env=dict(env), capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"code.framework mpi: {path} --version failed: {exc}") from None
    if "Open MPI" not in version:
        raise ConfigError(f"code.framework mpi: {path} is not Open MPI's mpirun ({version.strip()[:100]!r}); "
                          "Trainboard starts the ranks with Open MPI")
    return path


def run_mpirun(cfg: JobConfig, plan: LaunchPlan, script: UserScript, *, hosts: tuple[str, ...] = (),
               hardware_every_s: float = 0.0) -> int:
    """Start ``plan``'s ranks with our own mpirun (on ``hosts`` when there are several nodes) and
    wait for it; its exit code (128 + N when signal N ended it)."""
    env = _with_trainboard_env({k: v for k, v in os.environ.items() if k not in _RANK_VARS}, cfg)
    env.update(plan.extra_env)
    env.pop(LAUNCHED_BY_US, None)
    env["PYTHONPATH"] = _script_pythonpath(env, script)
    if hosts:
        env.update(MASTER_ADDR=plan.master_addr, MASTER_PORT=str(plan.master_port))
        # Open MPI's srun of its daemons: sharing the CPUs our own step holds (without it the step waits
        # for them forever), and with this environment (the batch script's sbatch --export=NONE left
        # SLURM_EXPORT_ENV=NONE, which that srun would obey: its daemons then die before they report).
        env.update(SLURM_OVERLAP="1", SLURM_EXPORT_ENV="ALL")
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(plan.nproc_per_node)))
    mpirun = _open_mpi(env)
    with watch_for_hangs(cfg, env, plan.world_size, watching=True):
        ours = {*trainboard_env(cfg), *plan.extra_env, "PYTHONPATH", "MASTER_ADDR", "MASTER_PORT",
                "OMP_NUM_THREADS", *([HANG_DIR] if HANG_DIR in env else [])}
        cmd = mpirun_command(plan, script, hosts=hosts, exported=tuple(sorted(ours)))
        cmd[0] = mpirun
        print_line(f"[launch] mpi: starting {plan.world_size} rank(s) with {mpirun} "
                   f"({'on ' + ','.join(hosts) if hosts else 'on this machine'})")
        code, _ = _supervise(cmd, env, cwd=script.code_dir, sampler=_node_sampler(plan, env, hardware_every_s))
    return 128 - code if code < 0 else code


def run_rank_here(cfg: JobConfig, plan: LaunchPlan, world: MpiWorld, script: UserScript, *,
                  hardware_every_s: float = 0.0) -> int:
    """This launcher is rank ``world.rank`` of the platform's mpirun: run ``script`` as a child with
    the rank's variables and wait; its exit code (128 + N when signal N ended it). The child stays in
    this process's group, so Open MPI's signals to the rank reach it; SIGTERM/SIGINT to this process
    are passed on."""
    ranks = rank_variables(world)
    os.environ.update(ranks)  # this process is the rank's too: its end-of-run step reads RANK
    env = _with_trainboard_env({k: v for k, v in os.environ.items() if k != LAUNCHED_BY_US}, cfg)
    env.update(plan.extra_env)
    env.update(ranks)
    if plan.master_addr and not env.get("MASTER_ADDR", "").strip():
        env.update(MASTER_ADDR=plan.master_addr, MASTER_PORT=str(plan.master_port))
    env["PYTHONPATH"] = _script_pythonpath(env, script)
    print_line(f"[launch] mpi: rank {world.rank} of {world.size} (local rank {world.local_rank} of "
               f"{world.local_size}, node_rank {world.node_rank}) started by {plan.platform}'s mpirun")
    with watch_for_hangs(cfg, env, world.size, watching=world.rank == 0):
        proc = subprocess.Popen([sys.executable, *_SCRIPT_ENTRY, *script.argv()], env=env, cwd=script.code_dir)

        def forward(signum, frame) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        sampling = _node_sampler(plan, env, hardware_every_s, node_fields=world.local_rank == 0)(proc.pid)
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:  # leaving on an exception: the rank goes with us
                proc.kill()
                proc.wait()
            if sampling is not None:
                sampling.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> None:
    """One rank under mpirun (:data:`RANK_ENTRY`): the rank's variables, then the script."""
    from trainer_pkg import rank_entry

    try:
        world = read_mpi_world(os.environ)
    except PlatformError as exc:
        sys.exit(f"trainer error: {exc}")
    if world is None:
        sys.exit("usage: mpirun ... python -m trainer_pkg.frameworks.mpi (SCRIPT.py | -m MODULE) [ARGS...] "
                 "(OMPI_COMM_WORLD_RANK is not set: run under Open MPI's mpirun)")
    os.environ.update(rank_variables(world))
    try:
        rank_entry.main(argv)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            abort_world(exc.code if isinstance(exc.code, int) else 1)
        raise


def abort_world(code: int) -> None:
    """After the script failed on this rank (an uncaught exception, its traceback printed, or a non-zero
    ``sys.exit``): ``MPI_Abort`` the whole world when the script initialized MPI through mpi4py, so
    mpirun stops every rank and the job fails now. Without it the other ranks wait in their next
    collective and this one in ``MPI_Finalize``, and the job hangs RUNNING until its max runtime (what
    ``python -m mpi4py`` does for a script run directly). Nothing when mpi4py is not loaded, or MPI
    is not initialized or already finalized."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return
        sys.stdout.flush()
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(code if 0 < code < 256 else 1)
    except Exception:  # noqa: BLE001 - an MPI that cannot abort leaves the exit to the caller
        return


if __name__ == "__main__":
    main(sys.argv[1:])
