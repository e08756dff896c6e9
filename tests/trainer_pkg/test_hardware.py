"""The launcher's hardware sampling (trainer_pkg/hardware.py): a script job's ranks' CPU and resident
memory, the NVML stand-in's GPU figures (tests/standins/fake_nvml) and the node's rates arrive as
``hardware`` records on the launcher's stdout, with no trainer code in the script, and parse through
the sync into stored points (jobs/sync.py → jobs/metric_store.py) and the job page's hardware payload.

Two tests start processes (the launcher with the torch-free torchrun and two ranks; torchrun started
without our launcher, as a GPU box does); the others sample this test process itself.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from test_platforms import clean_env
from trainer_helpers import REPO, python
from trainer_pkg import hardware, report
from trainer_pkg.metrics import parse_metric_line
from user_scripts import write_code

FAKE_NVML = REPO / "tests" / "standins" / "fake_nvml"
EVERY_S = 1.0
HOLD_MB = (40, 80)
"""Megabytes each rank's script holds (touched), by rank: rank 1's RSS is 40 MB above rank 0's."""

# Each rank holds its megabytes, then keeps one core busy for SPIN_S seconds: long enough for a few
# samples at EVERY_S. No trainer code: the launcher alone samples it.
SPIN_S = 3.2
HOLD_SCRIPT = f'''
import os, time
hold = bytearray({HOLD_MB}[int(os.environ["RANK"])] * 1_000_000)
for i in range(0, len(hold), 4096):
    hold[i] = 1
print("held at", os.environ["RANK"], time.time(), flush=True)
end = time.monotonic() + {SPIN_S}
n = 0
while time.monotonic() < end:
    n += 1
'''


def _held(stdout: str) -> dict[int, float]:
    """{rank: Unix time at which HOLD_SCRIPT's rank had touched its bytes} from its ``held at`` lines."""
    held = {int(rank): float(at) for line in stdout.splitlines() if line.startswith("held at ")
            for rank, at in [line.split()[2:4]]}
    assert sorted(held) == [0, 1], stdout[-2000:]
    return held


def _fake_gpu(index: int) -> list[float | None]:
    """What tests/standins/fake_nvml/pynvml.py reports for GPU ``index``, in hardware.GPU_FIELDS order."""
    return [10.0 * (index + 1), 1500.0 * (index + 1), None if index == 3 else 100.0 + index, 50.0 + index,
            1400.0 + index]


@pytest.mark.django_db
def test_a_scripts_ranks_are_sampled_and_their_series_are_stored(tmp_path, user, digits_dataset, cnn_model,
                                                                 local_backend):
    from jobs import comparison, dispatch, metric_store, services, sync
    from taskkit import sent_tasks

    code = write_code(tmp_path / "code", HOLD_SCRIPT)
    config = tmp_path / "job.json"
    config.write_text('{"output": {"output_dir": "%s"}, "code": {"dir": "%s", "script": "train.py"}}'
                      % (tmp_path / "out", code))
    env = clean_env(CUDA_VISIBLE_DEVICES="3,1")  # rank 0 uses GPU 3 (no power reading), rank 1 GPU 1
    env["PYTHONPATH"] = os.pathsep.join((str(FAKE_NVML), env["PYTHONPATH"]))
    env.pop(hardware.EVERY_ENV, None)
    cmd = [python(), "-m", "trainer_pkg.launch", "--config", str(config), "--standalone", "--nproc-per-node", "2",
           "--hardware-every-s", str(EVERY_S)]
    started = time.monotonic()
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if parse_metric_line(line)]
    records = [parse_metric_line(line) for line in lines]
    assert records and all(r["event"] == "hardware" for r in records)  # the script reports nothing itself

    # How many: one at most per interval over the launcher's life (the first reading, before the
    # ranks exist, sends nothing), and the ranks' SPIN_S seconds hold at least two.
    assert 2 <= len(records) <= math.floor(wall / EVERY_S) + 1, (len(records), wall)
    times = [r["time"] for r in records]
    assert all(later - earlier >= 0.9 * EVERY_S for earlier, later in zip(times, times[1:]))
    # A sample taken before a rank had touched its bytes (a loaded machine can start the sampler first)
    # sees the interpreter alone: the held bytes are asserted from the samples after both said so.
    held = _held(run.stdout)
    after = [r for r in records if r["time"] >= max(held.values())]
    assert after, (held, times)
    for r in after:
        rss = r["sys/rss_mb"]
        for rank in (0, 1):  # the held bytes plus an interpreter's own (~10-30 MB)
            assert HOLD_MB[rank] < rss[rank] < HOLD_MB[rank] + 150, rss
        assert 25 < rss[1] - rss[0] < 55, rss  # each rank's own memory, not its neighbour's
    for r in records:
        assert r["ranks"] == [0, 1] and r["node_rank"] == 0
        assert all(0 < mb < HOLD_MB[rank] + 150 for rank, mb in enumerate(r["sys/rss_mb"])), r["sys/rss_mb"]
        assert r["gpu_ranks"] == [0, 1]
        for field, values in zip(hardware.GPU_FIELDS, zip(_fake_gpu(3), _fake_gpu(1))):
            assert r[field] == list(values), field
        for field in hardware.NODE_FIELDS:
            assert r.get(field, 0.0) >= 0.0
    cpu = [c for r in records[1:] for c in r["sys/cpu_pct"]]
    assert cpu and all(c is not None and 0.0 <= c <= 110.0 for c in cpu), cpu  # one busy core at most
    assert sum(cpu) / len(cpu) > 10.0, cpu  # the ranks spin: they are seen busy
    assert "sys/net_recv_mb_s" in records[-1] and "sys/disk_read_mb_s" in records[-1]

    # Through the sync, as a backend's log lines would bring them.
    with sent_tasks(dispatch.SUBMIT_JOB):
        job = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                           backend=local_backend, nodes=1, procs_per_node=2, epochs=1, name="hw")
    now = dt.datetime.now(dt.timezone.utc)
    sync._ingest_lines(job, run.stdout.splitlines(), 0, now, lambda text: text)
    stored = metric_store.points(job.pk, names=metric_store.HARDWARE_NAMES)
    for rank in (0, 1):
        rss = stored[("sys/rss_mb", rank)]
        assert rss.steps.tolist() == [int(t) for t in times]  # stepped by the sample's Unix second
        assert rss.value_list() == [r["sys/rss_mb"][rank] for r in records]
        assert stored[("sys/gpu_temp_c", rank)].value_list() == [50.0 + (3, 1)[rank]] * len(records)
        assert len(stored[("sys/cpu_pct", rank)]) == len(records) - 1  # no CPU figure at a rank's first sample
    assert ("sys/gpu_power_w", 0) not in stored  # GPU 3 has no power reading: no point, not a zero
    assert stored[("sys/gpu_power_w", 1)].value_list() == [101.0] * len(records)
    sent = [r["sys/net_sent_mb_s"] for r in records if "sys/net_sent_mb_s" in r]  # a rate needs a reading before
    assert len(sent) >= len(records) - 1 and stored[("sys/net_sent_mb_s", 0)].value_list() == sent
    job.refresh_from_db()
    assert not any(name.startswith("sys/") for name in job.final_metrics)
    assert job.state == "QUEUED"  # a hardware record is not a sign of training

    charted = comparison.training_job_hardware_series(job=job)
    assert charted["lines"] is True and charted["t0"] == pytest.approx(min(times), abs=1e-3)
    assert [p["y"] for p in charted["series"]["sys/rss_mb"]["1"]] == [r["sys/rss_mb"][1] for r in records]
    assert charted["series"]["sys/gpu_util_pct"] == {
        "0": [{"x": int(t), "y": 40.0, "t": pytest.approx(t, abs=1e-3)} for t in times],
        "1": [{"x": int(t), "y": 20.0, "t": pytest.approx(t, abs=1e-3)} for t in times]}
    page = comparison.training_job_chart_series(job=job)
    assert page["rank_series"] == {} and page["series"] == {} and page["t0"] is None  # the step charts: none


def test_ranks_of_a_torchrun_no_launcher_samples_sample_their_own_scripts(tmp_path):
    """A GPU box starts torchrun itself (its supervisor, not our launcher, is torchrun's parent) with
    each rank running the launcher: each rank's launcher samples its script's process, and only local
    rank 0's sends the node's figures."""
    from trainer_pkg.platforms import LAUNCHED_BY_US

    code = write_code(tmp_path / "code", HOLD_SCRIPT)
    config = tmp_path / "job.json"
    config.write_text('{"output": {"output_dir": "%s"}, "code": {"dir": "%s", "script": "train.py"}}'
                      % (tmp_path / "out", code))
    env = clean_env(**{LAUNCHED_BY_US: "local", hardware.EVERY_ENV: f"{EVERY_S:g}"})
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "2",
           "-m", "trainer_pkg.launch", "--config", str(config)]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [r for r in map(parse_metric_line, run.stdout.splitlines()) if r is not None]
    by_rank = {rank: [r for r in records if r["ranks"] == [rank]] for rank in (0, 1)}
    held = _held(run.stdout)
    assert len(records) == len(by_rank[0]) + len(by_rank[1])  # each rank's own records, no other shape
    for rank, mine in by_rank.items():
        assert len(mine) >= 2, records
        # The first reading is taken as the script starts, before it holds its bytes (on a loaded
        # machine a later one can be too): the held bytes from the readings after the rank said so.
        assert all(0 < r["sys/rss_mb"][0] < HOLD_MB[rank] + 150 for r in mine), mine
        after = [r for r in mine if r["time"] >= held[rank]]
        assert after and all(HOLD_MB[rank] < r["sys/rss_mb"][0] < HOLD_MB[rank] + 150 for r in after), mine
        assert mine[0]["sys/cpu_pct"] == [None] and all(r["sys/cpu_pct"][0] is not None for r in mine[1:])
        assert all(("sys/net_recv_mb_s" in r) == (rank == 0 and r is not mine[0]) for r in mine)


def test_one_reading_of_this_process_matches_its_own_accounts():
    """A sampler of this process (rank 3 of no launcher): its RSS (with its children's) as /proc reads
    it, its CPU % as the CPU time the process spent between two readings, and the stand-in's GPU 2
    through the first device of CUDA_VISIBLE_DEVICES (a UUID)."""
    import sys

    real = sys.modules.pop("pynvml", None)  # nvidia-ml-py's, if something imported it already
    sys.path.insert(0, str(FAKE_NVML))
    try:
        gpus = hardware.open_gpus({"CUDA_VISIBLE_DEVICES": "GPU-fake-2"})
    finally:
        sys.path.remove(str(FAKE_NVML))
        sys.modules.pop("pynvml", None)
        if real is not None:
            sys.modules["pynvml"] = real
    assert gpus is not None
    emitted: list[str] = []
    sampler = hardware.Sampler(os.getpid(), interval_s=1.0, node_rank=2, self_rank=3, gpus=gpus, emit=emitted.append)
    first = sampler.record()
    assert first["ranks"] == [3] and first["sys/cpu_pct"] == [None] and first["node_rank"] == 2
    me = psutil.Process()
    tree = [me, *me.children(recursive=True)]  # a rank counts its children (pytest may have some)
    cpu_before = [sum(p.cpu_times()[:2]) for p in tree]
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn 0.3 s of CPU between the readings
        pass
    second = sampler.record()
    spent = sum(sum(p.cpu_times()[:2]) - before for p, before in zip(tree, cpu_before))
    assert second["sys/cpu_pct"][0] * second["interval_s"] / 100 == pytest.approx(spent, abs=0.05)
    rss_mb = sum(p.memory_info().rss for p in tree) / 1e6
    assert second["sys/rss_mb"][0] == pytest.approx(rss_mb, rel=0.05)
    assert [second[f][0] for f in hardware.GPU_FIELDS] == _fake_gpu(2) and second["gpu_ranks"] == [3]
    assert "sys/net_recv_mb_s" in second and "sys/net_recv_mb_s" not in first  # a rate needs two readings
    sampler.sample()
    assert len(emitted) == 1 and parse_metric_line(emitted[0])["ranks"] == [3]
    sampler.stop()


@pytest.mark.parametrize(("flag", "env", "expected"), [
    (None, {}, hardware.DEFAULT_EVERY_S), (None, {hardware.EVERY_ENV: "0"}, 0.0),
    (None, {hardware.EVERY_ENV: " 2.5 "}, 2.5), (10.0, {hardware.EVERY_ENV: "0"}, 10.0)])
def test_the_interval_comes_from_the_flag_then_the_environment(flag, env, expected):
    assert hardware.every_s(flag, env) == expected


@pytest.mark.parametrize("value", ["abc", "-1", "0.5", "nan", "inf"])
def test_a_bad_interval_is_refused_naming_its_source(value):
    with pytest.raises(ValueError, match=hardware.EVERY_ENV):
        hardware.every_s(None, {hardware.EVERY_ENV: value})


def test_a_bad_interval_exits_2_before_anything_runs(tmp_path, capfd):
    from trainer_pkg import launch

    config = tmp_path / "job.json"
    config.write_text('{"output": {"output_dir": "%s"}}' % (tmp_path / "out"))
    assert launch.main(["--config", str(config), "--hardware-every-s", "0.2"]) == 2
    assert "--hardware-every-s must be 0 (off) or at least 1 seconds" in capfd.readouterr().err


def test_a_script_may_not_report_under_the_hardware_prefix():
    with pytest.raises(ValueError, match="'sys/gpu_util_pct' starts with 'sys/'"):
        report.log(step=0, **{"sys/gpu_util_pct": 3.0})
