"""End to end: a real Celery worker runs a 1-epoch digits job on the GPU box (torchrun, gloo), then a
job continued from its checkpoint to 2 epochs: it reaches SUCCEEDED, reports epoch 1 (the second)
only, resumed from the source's step, and both pages show the lineage."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from jobs import services
from jobs.models import JobStateChoices as S, MetricPoint, TrainingJob

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _reload(job: TrainingJob) -> TrainingJob:
    return TrainingJob.objects.get(pk=job.pk)


def _val_epochs(job: TrainingJob) -> list[int]:
    return list(MetricPoint.objects.filter(job=job, name="val_loss", rank__isnull=True)
                .order_by("step").values_list("epoch", flat=True))


def test_a_continued_job_trains_the_second_epoch_from_the_first_jobs_checkpoint(
        celery_worker_process, user, digits_dataset, cnn_model, local_backend, run_root):
    first = services.training_job_create(owner=user, dataset=digits_dataset, model_spec=cnn_model,
                                         backend=local_backend, nodes=1, procs_per_node=2, epochs=1, batch_size=32,
                                         name="digits-1")
    first = celery_worker_process.wait_for(lambda: (j := _reload(first)).is_terminal and j, timeout=300,
                                           what="the first job to end")
    assert first.state == S.SUCCEEDED, (first.failure_reason, celery_worker_process.log()[-3000:])
    assert _val_epochs(first) == [0]
    first_steps = MetricPoint.objects.filter(job=first, name="val_loss").values_list("step", flat=True).get()

    cont = services.training_job_clone(owner=user, job=first, overrides={"init_mode": "continue", "epochs": 2})
    assert cont.config["train"]["init_from"] == str(
        run_root / first.provider_job_name / "output" / "checkpoints" / "last.pt")
    cont = celery_worker_process.wait_for(lambda: (j := _reload(cont)).is_terminal and j, timeout=300,
                                          what="the continued job to end")
    assert cont.state == S.SUCCEEDED, (cont.failure_reason, celery_worker_process.log()[-3000:])
    assert _val_epochs(cont) == [1]  # the second epoch only: the first came from the checkpoint
    steps = sorted(MetricPoint.objects.filter(job=cont, name="train_loss", rank__isnull=True)
                   .values_list("step", flat=True))
    assert steps and steps[0] > first_steps  # counted on from the source's optimizer steps
    assert cont.final_metrics["val_accuracy"] > 0.5
    log = (run_root / cont.provider_job_name / "train.log").read_text()
    assert f"continuing from {cont.config['train']['init_from']}" in log

    web = Client()
    web.force_login(user)
    page = web.get(reverse("job-detail", args=[cont.pk])).content.decode()
    assert f"continued from #{first.pk} (checkpoint epoch 1)" in page
    source_page = web.get(reverse("job-detail", args=[first.pk])).content.decode()
    assert f"#{cont.pk} digits-1 (continued from #{first.pk})" in source_page
    assert 'id="continue-job"' in source_page and 'id="finetune-job"' in source_page
