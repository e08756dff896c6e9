"""The batch script of one Slurm job, and the checks of what goes into it.

One job is one ``sbatch`` of :func:`batch_script`: ``#SBATCH`` lines built from validated values only,
then a short bash body that unpacks the trainer archive into the run directory, reads the job's
environment file and runs ``srun`` with one task per node, each task starting
``python -m trainer_pkg.launch --config job.json --platform slurm`` (which starts torchrun with the
node's processes; :func:`trainer_pkg.platforms.read_slurm`). Slurm runs the batch script on the first
node of the allocation (sbatch(1), "DESCRIPTION"), so the exit marker it writes at the end is what
the adapter reads once the controller has forgotten the job.

Nothing here reaches a shell unquoted: paths are checked against :data:`PATH_RE` (no quote, space or
``$``) and quoted with :func:`shlex.quote` all the same; the job's variables go to a file of mode
0600 (:func:`env_file`), never to the script or a command line; ``extra_sbatch_options`` become
``#SBATCH`` lines, which sbatch parses itself, after :func:`sbatch_option_problems` has allowed each.
"""

from __future__ import annotations

import re
import shlex
from typing import Iterable, Mapping, Sequence

PATH_RE = re.compile(r"/[A-Za-z0-9_.+/-]{0,4095}")
"""An absolute path on the cluster that needs no quoting in a ``#SBATCH`` line or a shell."""
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
"""A partition, account, QoS or cluster name (Slurm's names: letters, digits, ``_ . + -``)."""
OPTION_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:=@/+%\[\]-]{1,200}")
"""The characters an allowed option's value may hold: no space, quote, ``$``, backtick or newline."""

ALLOWED_SBATCH_OPTIONS: dict[str, str] = {
    "--constraint": "value", "--exclude": "value", "--nodelist": "value", "--reservation": "value",
    "--exclusive": "flag-or-value", "--mem-per-cpu": "value", "--mem-per-gpu": "value", "--tmp": "value",
    "--mail-type": "value", "--mail-user": "value", "--begin": "value", "--deadline": "value",
    "--nice": "value", "--licenses": "value", "--switches": "value", "--hint": "value",
    "--requeue": "flag", "--no-requeue": "flag", "--signal": "value", "--wckey": "value",
    "--gpu-bind": "value", "--gpu-freq": "value", "--cpu-freq": "value", "--threads-per-core": "value",
    "--sockets-per-node": "value", "--cores-per-socket": "value", "--distribution": "value",
    "--network": "value", "--priority": "value", "--time-min": "value", "--spread-job": "flag",
    "--use-min-nodes": "flag", "--contiguous": "flag", "--overcommit": "flag", "--oversubscribe": "flag",
}
"""sbatch options a backend may add (sbatch(1), Slurm 22.05): placement, mail, scheduling hints.
"flag": no value; "value": ``--option=value``; "flag-or-value": either."""

REFUSED_SBATCH_OPTIONS: dict[str, str] = {
    "--uid": "would run the job as another user", "--gid": "would run the job as another group",
    "--chdir": "would move the job out of its run directory", "-D": "would move the job out of its run directory",
    "--export": "would pass the worker's environment to the job", "--export-file": "would read variables from a file",
    "--get-user-env": "would load a login environment into the job",
    "--wrap": "would replace the batch script with a command", "--output": "Trainboard reads the job's output file",
    "--error": "Trainboard reads the job's output file", "--input": "would feed the job a file",
    "--open-mode": "Trainboard sets it", "--job-name": "the job's name is how Trainboard finds it",
    "--comment": "Trainboard's tag is the job's comment", "--array": "one job is one allocation",
    "--nodes": "set by the job's node count", "--ntasks-per-node": "Trainboard runs one task per node",
    "--ntasks": "Trainboard runs one task per node", "--time": "set from the job's max runtime",
    "--partition": "a backend setting", "--account": "a backend setting", "--qos": "a backend setting",
    "--gres": "set from GPUs per node", "--gpus-per-node": "set from GPUs per node",
    "--cpus-per-task": "a backend setting", "--mem": "a backend setting",
    "--container-image": "a backend setting checked against the allowed images",
    "--propagate": "would pass the worker's limits to the job", "--parsable": "Trainboard's own",
    "--dependency": "jobs are independent", "--clusters": "the backend is one cluster", "-M": "the backend is one cluster",
}
"""Options refused, each with why (they decide where, as whom or on what the job runs, or are
Trainboard's own)."""


def split_options(value: object) -> list[str] | None:
    """``extra_sbatch_options`` as a list: a JSON list of strings, or one text with the options
    separated by spaces or newlines; None when it is neither."""
    if isinstance(value, str):
        return [o for o in re.split(r"[ \t\r\n]+", value) if o]
    if isinstance(value, (list, tuple)) and all(isinstance(o, str) for o in value):
        return list(value)
    return None


def sbatch_option_problems(options: Sequence[str]) -> list[str]:
    """Why each of ``options`` may not be added; [] when all are allowed. Each message names the
    option and says what to do."""
    problems = []
    allowed = ", ".join(sorted(ALLOWED_SBATCH_OPTIONS))
    for option in options:
        shown = repr(option[:60])
        name, has_value, value = option.partition("=")
        if any(c in option for c in "\r\n\0"):
            problems.append(f"{shown}: an option may not hold a line break.")
        elif name in REFUSED_SBATCH_OPTIONS or (not name.startswith("--") and name[:2] in REFUSED_SBATCH_OPTIONS):
            key = name if name in REFUSED_SBATCH_OPTIONS else name[:2]
            problems.append(f"{name if key == name else key} is not allowed ({REFUSED_SBATCH_OPTIONS[key]}).")
        elif name not in ALLOWED_SBATCH_OPTIONS:
            problems.append(f"{shown} is not an sbatch option Trainboard allows; write --option=value with one of: "
                            f"{allowed}.")
        elif ALLOWED_SBATCH_OPTIONS[name] == "flag" and has_value:
            problems.append(f"{name} takes no value; write {name} alone.")
        elif ALLOWED_SBATCH_OPTIONS[name] == "value" and not has_value:
            problems.append(f"{name} needs a value; write {name}=VALUE.")
        elif has_value and not OPTION_VALUE_RE.fullmatch(value):
            problems.append(f"{name}: the value {value[:60]!r} may hold only letters, digits and _ . , : = @ / + % [ ] - "
                            f"(1–200 characters, no spaces or quotes).")
    return problems


def time_limit(max_runtime_s: int) -> str:
    """``--time`` for ``max_runtime_s`` seconds: ``D-HH:MM:SS`` rounded up to whole minutes, since
    Slurm keeps time limits in minutes (sbatch(1) ``--time``)."""
    minutes = max(1, -(-int(max_runtime_s) // 60))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def env_file(env: Mapping[str, str]) -> bytes:
    """The job's variables as ``export NAME='value'`` lines for the batch script to read (``.``),
    each value quoted with :func:`shlex.quote`. Names must be checked first (variable names) and
    values hold no NUL. Written with mode 0600: secrets never reach argv or the script."""
    lines = ["# The job's environment, written by Trainboard (mode 0600); read by job.sbatch."]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    return ("\n".join(lines) + "\n").encode()


def batch_script(*, job_name: str, run_dir: str, archive: str, nodes: int, procs_per_node: int,
                 max_runtime_s: int, python: str, partition: str = "", account: str = "", qos: str = "",
                 gpus_per_node: int = 0, gpu_request: str = "gres", cpus_per_task: int = 0,
                 mem_per_node_gb: int = 0, comment: str = "", extra_options: Iterable[str] = (),
                 container_image: str = "", container_mounts: Sequence[str] = ()) -> str:
    """The text of ``job.sbatch``. Every argument must already be checked: names by :data:`NAME_RE`,
    paths by :data:`PATH_RE`, ``extra_options`` by :func:`sbatch_option_problems`, ``python`` an
    absolute path or a bare command name. ``archive``: the trainer archive (.tar.gz) on the shared
    filesystem; the script unpacks it into ``<run_dir>/app`` once and runs the launcher from there.
    ``cpus_per_task`` 0 = ``procs_per_node`` (one CPU per process at least)."""
    log = f"{run_dir}/slurm.log"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={cpus_per_task or procs_per_node}",
        f"#SBATCH --time={time_limit(max_runtime_s)}",
    ]
    lines += [f"#SBATCH --{flag}={value}" for flag, value in
              (("partition", partition), ("account", account), ("qos", qos)) if value]
    if gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{gpus_per_node}" if gpu_request == "gres"
                     else f"#SBATCH --gpus-per-node={gpus_per_node}")
    if mem_per_node_gb:
        lines.append(f"#SBATCH --mem={mem_per_node_gb}G")
    lines += [
        f"#SBATCH --output={log}",
        f"#SBATCH --error={log}",
        "#SBATCH --open-mode=append",
        "#SBATCH --export=NONE",
    ]
    if comment:
        lines.append(f"#SBATCH --comment={comment}")
    lines += [f"#SBATCH {option}" for option in extra_options]
    q = shlex.quote
    srun = ["srun", "--export=ALL", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if container_image:
        srun += [f"--container-image={container_image}", f"--container-mounts={','.join(container_mounts)}",
                 f"--container-workdir={run_dir}"]
    srun += [python, "-m", "trainer_pkg.launch", "--config", f"{run_dir}/job.json", "--platform", "slurm",
             "--nproc-per-node", str(procs_per_node)]
    lines += [
        "# Written by Trainboard. Runs on the first node of the allocation: srun starts one task per node,",
        "# each running trainer_pkg.launch, which starts torchrun with that node's processes.",
        "set -u",
        "umask 077",
        "export PATH=/usr/local/bin:/usr/bin:/bin",
        f"run_dir={q(run_dir)}",
        'cd "$run_dir" || exit 1',
        'started_at=$(date +%s)',
        '. "$run_dir/job.env"',
        'finish() {',
        '    printf \'{"returncode": %d, "started_at": %s, "ended_at": %s}\\n\' "$1" "$started_at" "$(date +%s)" \\',
        '        > "$run_dir/.exit.json.tmp" && mv -f "$run_dir/.exit.json.tmp" "$run_dir/exit.json"',
        '    exit "$1"',
        '}',
        'if [ ! -f "$run_dir/app/.unpacked" ]; then',
        f'    mkdir -p "$run_dir/app" && tar -xzf {q(archive)} -C "$run_dir/app" && touch "$run_dir/app/.unpacked" \\',
        '        || { echo "trainer error: cannot unpack the trainer archive into $run_dir/app" >&2; finish 1; }',
        'fi',
        'export PYTHONPATH="$run_dir/app"',
        'export PYTHONUNBUFFERED=1',
        f"{shlex.join(srun)}",
        'finish "$?"',
    ]
    return "\n".join(lines) + "\n"
