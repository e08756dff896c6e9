"""What a user reads about a backend's max runtime names the provider's public documentation, not this
repository's files or the SDK's internals, and describes that backend (a GPU box launches no instances)."""

from __future__ import annotations

import re

import pytest

from cloud_adapters import registry
from webapp.forms import MAX_RUNTIME_HELP

INTERNAL = re.compile(r"clouds\.md|§|botocore|aiplatform_v1|azure-ai-ml|\.py\b|MaxRuntime|torchrun")

COVERS = {
    "gpubox": "the run from the moment the job starts on the box, so installing the code's requirements, "
              "connecting the processes and loading the data count; at the limit the processes get SIGTERM and, "
              "once the cancel grace period is over, are killed",
    "sagemaker": "the whole training job from its start, so launching the instances and downloading the image and "
                 "the data count; at the limit SageMaker sends the training processes SIGTERM and stops the job "
                 "120 s later (AWS SageMaker API reference, StoppingCondition)",
    "vertex": "the job's whole running time (Vertex AI's maximum job running time), the machines starting and the "
              "image download included (Vertex AI API reference, Scheduling timeout)",
    "azureml": "the whole job, preparing the environment and starting the nodes included; at the limit Azure ML "
               "cancels the job (Azure Machine Learning documentation, command job timeout)",
    "slurm": "the job's run on its nodes from the moment Slurm starts it (time waiting in the queue does not count), "
             "rounded up to whole minutes; at the limit Slurm sends the processes SIGTERM, then SIGKILL (Slurm "
             "documentation, sbatch --time)",
    "kubernetes": "the TrainJob's active time from its start (restarted when a suspended job is resumed): scheduling "
                  "the pods, pulling the image and connecting the nodes count; at the limit Kubeflow Trainer "
                  "terminates the pods (Kubeflow Trainer API reference, TrainJob activeDeadlineSeconds)",
    "ray": "the job's run from the moment its driver starts on the Ray cluster, so waiting for the workers' resources, "
           "starting them and loading the data count; at the limit every rank gets SIGTERM, then SIGKILL 30 s later "
           "(Ray's Job Submission API has no time limit of its own: Trainboard's entrypoint keeps it)",
}


@pytest.mark.parametrize("kind", list(registry.KINDS))
def test_each_backend_says_in_plain_words_what_its_max_runtime_counts(kind):
    covers = registry.backend_class(kind).max_runtime_covers
    assert covers == COVERS[kind]
    assert not INTERNAL.search(covers), covers


def test_the_max_runtime_help_fits_every_backend():
    assert not INTERNAL.search(MAX_RUNTIME_HELP), MAX_RUNTIME_HELP
    assert "on a cloud, launching the machines" in MAX_RUNTIME_HELP
    assert "on a GPU box, starting the processes and loading the data" in MAX_RUNTIME_HELP
