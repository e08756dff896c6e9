"""The job's full log (docs/experiments.md, "Logs"): pages, search, the rank filter on the marks real
torchrun runs and our launcher and trainer put on a rank's lines, hidden metric records, the cursor
that stays stable while the job writes, and the whole log as text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import selectors
from jobs.models import JobLogLine, TrainingJob
from trainer_pkg import launch, metrics
from trainer_pkg.metrics import format_metric_line

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job(user, digits_dataset, cnn_model, local_backend):
    return TrainingJob.objects.create(owner=user, dataset=digits_dataset, model_spec=cnn_model, backend=local_backend,
                                      name="logged", state="RUNNING", config={})


def store(job, texts, start=0):
    JobLogLine.objects.bulk_create(JobLogLine(job=job, seq=start + i, text=t) for i, t in enumerate(texts))


def test_pages_of_500_newest_reachable(job):
    store(job, [f"line {i}" for i in range(1203)])
    newest = selectors.training_job_log_page(job=job)
    assert (newest.number, newest.num_pages, newest.count, len(newest.lines)) == (3, 3, 1203, 203)
    assert newest.lines[0] == (1000, "line 1000") and newest.lines[-1] == (1202, "line 1202")
    first = selectors.training_job_log_page(job=job, page=1)
    assert first.lines[0] == (0, "line 0") and first.lines[-1] == (499, "line 499") and first.has_next
    assert selectors.training_job_log_page(job=job, page=99).number == 3  # past the end: the newest
    assert selectors.training_job_log_page(job=job, page=0).number == 1
    empty = selectors.training_job_log_page(job=job, q="nothing like this")
    assert (empty.number, empty.num_pages, empty.count, empty.lines) == (1, 1, 0, [])


def test_search_any_case_and_metric_records_hidden_unless_asked(job):
    record = format_metric_line({"event": "step", "step": 3, "loss": 0.5})
    store(job, ["[trainer] epoch 0: val_loss 2.0578 val_accuracy 0.6351", record, "Epoch 1 done", "nothing"])
    page = selectors.training_job_log_page(job=job, q="EPOCH")
    assert page.lines == [(0, "[trainer] epoch 0: val_loss 2.0578 val_accuracy 0.6351"), (2, "Epoch 1 done")]
    assert [seq for seq, _ in selectors.training_job_log_page(job=job).lines] == [0, 2, 3]
    assert [seq for seq, _ in selectors.training_job_log_page(job=job, metrics=True).lines] == [0, 1, 2, 3]
    assert selectors.training_job_log_page(job=job, q="step", metrics=True).lines == [(1, record)]


def _launch_line(monkeypatch, capfd, rank: int) -> str:
    for name, value in {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    launch._log_rank("local")
    return capfd.readouterr().out.strip()


def _error_line(monkeypatch, capfd, rank: int, message: str) -> str:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    metrics.report_error(message)
    return capfd.readouterr().err.strip()


def test_rank_filter_on_the_launchers_and_trainers_own_marks(job, monkeypatch, capfd):
    launch0, launch1 = _launch_line(monkeypatch, capfd, 0), _launch_line(monkeypatch, capfd, 1)
    error1 = _error_line(monkeypatch, capfd, 1, "data.uri /x does not exist")
    assert launch1.startswith("[launch] rank 1 (local rank 1, node_rank 0) of world size 2")
    assert error1 == "trainer error: rank 1: data.uri /x does not exist"
    texts = [launch0, launch1, "[trainer] world size 2 (gloo on cpu), 1 CPU thread(s) per rank",
             "[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: bad shard",
             "[rank 1] the user's code raised (frames in the user's files only):",
             "[algo-2] [rank1]: ValueError: bad shard", "[node 1] " + launch1, "[rank11]: not rank 1",
             "[rank10]: RuntimeError: x", error1, "  rank      : 1 (local_rank: 1)", "[trainer] rank 1 (data-parallel 1 of 2) epoch 0: read shards [1]"]
    store(job, texts)
    got = [seq for seq, _ in selectors.training_job_log_page(job=job, rank=1).lines]
    assert [texts[s] for s in got] == [launch1, "[rank1]: Traceback (most recent call last):",
                                       "[rank1]: ValueError: bad shard",
                                       "[rank 1] the user's code raised (frames in the user's files only):",
                                       "[algo-2] [rank1]: ValueError: bad shard", "[node 1] " + launch1, error1,
                                       "  rank      : 1 (local_rank: 1)",
                                       "[trainer] rank 1 (data-parallel 1 of 2) epoch 0: read shards [1]"]
    assert [texts[s] for s, _ in selectors.training_job_log_page(job=job, rank=0).lines] == [launch0]
    assert [texts[s] for s, _ in selectors.training_job_log_page(job=job, rank=10).lines] == ["[rank10]: RuntimeError: x"]
    assert [texts[s] for s, _ in selectors.training_job_log_page(job=job, rank=1, q="valueerror").lines] == [
        "[rank1]: ValueError: bad shard", "[algo-2] [rank1]: ValueError: bad shard"]


@pytest.mark.slow
def test_rank_filter_on_a_real_torchrun_run(job, tmp_path):
    """Two ranks under torchrun (gloo) through our launcher; rank 1 raises. Its lines are what torch
    prints (``[rank1]: Traceback ...``) and torchrun's failure summary; an unmarked print is no rank's."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "print(f'hello from rank {rank}', flush=True)\n"
        "if rank == 1:\n"
        "    raise ValueError('bad shard on rank 1')\n"
        "dist.barrier()\n")
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"code": {"dir": str(code), "script": "train.py"},
                                  "output": {"output_dir": str(tmp_path / "out")}}))
    done = subprocess.run([sys.executable, "-m", "trainer_pkg.launch", "--config", str(config), "--standalone",
                           "--nproc-per-node", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    texts = (done.stdout + done.stderr).splitlines()
    store(job, texts)
    rank1 = [text for _, text in selectors.training_job_log_page(job=job, rank=1).lines]
    assert rank1[:4] == ["[rank1]: Traceback (most recent call last):",
                         f'[rank1]:   File "{code / "train.py"}", line 6, in <module>',
                         "[rank1]:     raise ValueError('bad shard on rank 1')",
                         "[rank1]: ValueError: bad shard on rank 1"]
    assert rank1[4:] == ["  rank      : 1 (local_rank: 1)"]  # torchrun's summary of the root cause
    # An unmarked print is in the log but no rank's. Two ranks printing at once under PYTHONUNBUFFERED
    # (GPU boxes set it; so do many CI runners) write text and newline separately, so rank 0's and
    # rank 1's hellos can share a line: look for the text, not for a line of its own.
    assert "hello from rank 1" in done.stdout
    assert not any("hello from rank" in text for text in rank1)
    rank0 = [text for _, text in selectors.training_job_log_page(job=job, rank=0).lines]
    assert rank0[0] == "[rank0]: Traceback (most recent call last):"
    assert all(t.startswith("[rank0]:") for t in rank0[:-1]) and rank0[-1] == "  rank      : 0 (local_rank: 0)"


def test_cursor_is_stable_while_the_job_writes(job):
    store(job, ["a0", "b1", "a2", "b3"])
    lines, cursor, more = selectors.training_job_log_after(job=job, limit=2)
    assert (lines, cursor, more) == ([(0, "a0"), (1, "b1")], 1, True)
    lines, cursor, more = selectors.training_job_log_after(job=job, after=cursor, limit=2)
    assert (lines, cursor, more) == ([(2, "a2"), (3, "b3")], 3, False)
    assert selectors.training_job_log_after(job=job, after=3) == ([], 3, False)
    # A filter that matches nothing still moves the cursor past what it looked at.
    assert selectors.training_job_log_after(job=job, after=-1, q="zzz") == ([], 3, False)
    store(job, ["a4", "zzz 5"], start=4)  # the job writes on
    assert selectors.training_job_log_after(job=job, after=3, q="ZZZ") == ([(5, "zzz 5")], 5, False)
    assert selectors.training_job_log_after(job=job, after=-1, q="a", limit=10) == (
        [(0, "a0"), (2, "a2"), (4, "a4")], 5, False)


def test_whole_log_as_text_in_pieces(job):
    record = format_metric_line({"event": "step", "step": 1})
    store(job, [f"line {i}" for i in range(5)] + [record])
    pieces = list(selectors.training_job_log_text(job=job, chunk_lines=2))
    assert pieces == ["line 0\nline 1\n", "line 2\nline 3\n", f"line 4\n{record}\n"]
    assert list(selectors.training_job_log_text(job=TrainingJob.objects.create(
        owner=job.owner, dataset=job.dataset, model_spec=job.model_spec, backend=job.backend, config={}))) == []


def test_a_long_log_is_searched_a_window_at_a_time_newest_first(job, monkeypatch, client, user):
    monkeypatch.setattr(selectors, "LOG_SEARCH_WINDOW", 10)
    store(job, [f"{'error' if i % 4 == 0 else 'ok'} {i}" for i in range(25)])  # errors at 0, 4, … 24
    # A page of the newest matches, looking back at most a window; the next search goes on from there.
    newest = selectors.training_job_log_page(job=job, q="ERROR")
    assert (newest.searched, newest.older, newest.count, newest.num_pages) == ((15, 24), 15, 3, 1)
    assert newest.lines == [(16, "error 16"), (20, "error 20"), (24, "error 24")]
    older = selectors.training_job_log_page(job=job, q="error", before=15, page=7)  # no pages in a search
    assert (older.searched, older.older, [s for s, _ in older.lines]) == ((5, 14), 5, [8, 12])
    oldest = selectors.training_job_log_page(job=job, q="error", before=5)
    assert (oldest.searched, oldest.older, [s for s, _ in oldest.lines]) == ((0, 4), None, [0, 4])
    # A full page stops at its oldest match: what was looked at, and where to go on.
    full = selectors.training_job_log_page(job=job, q="error", per_page=2)
    assert (full.searched, full.older, [s for s, _ in full.lines]) == ((20, 24), 20, [20, 24])
    # An unfiltered page ignores the window: every line is reachable by its page.
    plain = selectors.training_job_log_page(job=job, per_page=10)
    assert (plain.searched, plain.lines[0], plain.num_pages) == (None, (20, "error 20"), 3)
    # The API's filtered cursor moves at most a window a read, and says more remain.
    assert selectors.training_job_log_after(job=job, q="error") == ([(0, "error 0"), (4, "error 4"),
                                                                      (8, "error 8")], 9, True)
    assert selectors.training_job_log_after(job=job, after=9, q="error") == ([(12, "error 12"),
                                                                               (16, "error 16")], 19, True)
    assert selectors.training_job_log_after(job=job, after=19, q="error") == ([(20, "error 20"),
                                                                               (24, "error 24")], 24, False)
    # The page names what it searched; the link to older lines carries the search, not the page.
    client.force_login(user)
    html = client.get(f"/jobs/{job.pk}/logs/?q=error&page=1").content.decode()
    assert "3 lines match in lines 15–24, the newest first: a long log is searched at most 10 lines a page." in html
    assert 'id="log-search-older" href="?q=error&amp;before=15"' in html
    html = client.get(f"/jobs/{job.pk}/logs/?q=error&before=5").content.decode()
    assert "2 lines match in lines 0–4" in html and "That is the start of the log." in html
    assert "log-search-older" not in html
    assert client.get(f"/jobs/{job.pk}/logs/?q=error&before=x").status_code == 400
