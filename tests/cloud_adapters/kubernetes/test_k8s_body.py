"""The TrainJob body a job becomes (cloud_adapters.kubernetes.body), every field asserted, and the
settings checks of a Kubernetes backend (all problems at once). No API server: pure functions."""

from __future__ import annotations

import json

import pytest

from cloud_adapters.base import CodeBundle, InvalidSpec, JobSpec
from cloud_adapters.kubernetes import KubernetesBackend

BASE = {"kubeconfig": "/etc/trainboard/kubeconfig", "image": "ghcr.io/acme/trainer:1.4",
        "allowed_images": "ghcr.io/acme/*"}
CONFIG = {"data": {"dataset": "digits"}, "train": {"epochs": 2, "batch_size": 32}, "parallel": {"strategy": "ddp"}}


def backend(**settings):
    return KubernetesBackend({**BASE, **settings})


def spec(**fields):
    values = dict(job_name="tb-job-7-65a1b2c3", config=CONFIG, nodes=2, procs_per_node=2, max_runtime_s=5400,
                  tags={"trainboard-job-id": "7", "trainboard-owner-id": "3"}, env={"LOG_LEVEL": "debug"},
                  secret_env={"HF_TOKEN": "s3cr3t"})
    values.update(fields)
    return JobSpec(**values)


def test_the_whole_body_of_a_gpu_job_with_placement_and_kueue():
    b = backend(namespace="team-a", runtime="torch-distributed", gpus_per_node=2, cpu_request="8",
                memory_request="32Gi", node_selector="cloud.google.com/gke-nodepool=a100, disk=ssd",
                tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                service_account="trainer", suspend=True, queue_name="team-a-queue", output_path="/mnt/out")
    body = b.train_job(spec())
    env = body["spec"]["trainer"].pop("env")
    assert body == {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "tb-job-7-65a1b2c3", "namespace": "team-a",
                     "labels": {"kueue.x-k8s.io/queue-name": "team-a-queue", "trainboard-job-id": "7",
                                "trainboard-job-name": "tb-job-7-65a1b2c3"}},
        "spec": {
            "runtimeRef": {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "activeDeadlineSeconds": 5400,
            "suspend": True,
            "trainer": {
                "image": "ghcr.io/acme/trainer:1.4",
                "command": ["python", "-m", "trainer_pkg.launch", "--config", "env:TRAINBOARD_JOB_CONFIG",
                            "--platform", "kubernetes"],
                "numNodes": 2,
                "numProcPerNode": 2,
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": "2"},
                                     "requests": {"nvidia.com/gpu": "2", "cpu": "8", "memory": "32Gi"}},
            },
            "runtimePatches": [{"manager": "trainboard", "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
                    "nodeSelector": {"cloud.google.com/gke-nodepool": "a100", "disk": "ssd"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "serviceAccountName": "trainer"}}}}}]}}}}],
        },
    }
    names = [e["name"] for e in env]
    assert names == ["TRAINBOARD_JOB_CONFIG", "PYTHONUNBUFFERED", "TRAINBOARD_JOB_NAME", "LOG_LEVEL", "HF_TOKEN"]
    values = {e["name"]: e["value"] for e in env if "value" in e}
    assert set(env[0]) == {"name", "value"}
    assert values["PYTHONUNBUFFERED"] == "1" and values["TRAINBOARD_JOB_NAME"] == "tb-job-7-65a1b2c3"
    assert values["LOG_LEVEL"] == "debug"
    # The job secret is a reference into the job's own Secret, never its value.
    assert env[-1] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tb-job-7-65a1b2c3-env",
                                                                          "key": "HF_TOKEN"}}}
    assert "s3cr3t" not in json.dumps(body) + json.dumps(env)
    assert b.secret(spec()) == {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": "tb-job-7-65a1b2c3-env", "namespace": "team-a",
                     "labels": {"trainboard-job-id": "7", "trainboard-job-name": "tb-job-7-65a1b2c3"}},
        "data": {"HF_TOKEN": "czNjcjN0"}}  # base64 of s3cr3t
    assert b.secret(spec(secret_env={})) is None
    job_config = json.loads(values["TRAINBOARD_JOB_CONFIG"])
    assert job_config == {**CONFIG, "output": {"output_dir": "/mnt/out/tb-job-7-65a1b2c3",
                                               "checkpoint_dir": "/mnt/out/tb-job-7-65a1b2c3/checkpoints"}}


def test_a_cpu_job_has_no_resources_no_patches_no_suspend_and_the_defaults():
    body = backend().train_job(spec(nodes=1, procs_per_node=1, image="ghcr.io/acme/other:2", env={},
                                    secret_env={}, output_uri="s3://bucket/out", checkpoint_uri="s3://bucket/ckpt"))
    assert body["metadata"] == {"name": "tb-job-7-65a1b2c3", "namespace": "default",
                                "labels": {"trainboard-job-id": "7", "trainboard-job-name": "tb-job-7-65a1b2c3"}}
    assert set(body["spec"]) == {"runtimeRef", "activeDeadlineSeconds", "trainer"}
    assert body["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = body["spec"]["trainer"]
    assert set(trainer) == {"image", "command", "env", "numNodes", "numProcPerNode"}
    assert trainer["image"] == "ghcr.io/acme/other:2"  # the job's own image wins
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (1, 1)
    output = json.loads(trainer["env"][0]["value"])["output"]
    assert output == {"output_dir": "s3://bucket/out", "checkpoint_dir": "s3://bucket/ckpt"}
    cpu_only = backend(cpu_request="500m", memory_request="4Gi").train_job(spec())
    assert cpu_only["spec"]["trainer"]["resourcesPerNode"] == {"requests": {"cpu": "500m", "memory": "4Gi"}}


@pytest.mark.parametrize("fields, message", [
    ({"env": {"PET_NNODES": "3"}}, "env PET_NNODES: the name is set by Trainboard or Kubeflow Trainer"),
    ({"env": {"TRAINBOARD_JOB_CONFIG": "{}"}}, "env TRAINBOARD_JOB_CONFIG: the name is set by Trainboard"),
    ({"secret_env": {"1BAD": "x"}}, "job secret '1BAD': Kubernetes variable names are letters"),
    ({"env": {f"V{i}": "x" for i in range(130)}}, "a TrainJob takes at most 128"),
    ({"job_name": "Tb_Job_7"}, "job name 'Tb_Job_7': a TrainJob's name is at most 63 lowercase letters"),
    ({"job_name": "7-tb"}, "starting with a letter"),
    ({"image": "docker.io/evil/miner:1"}, "image 'docker.io/evil/miner:1' is not among the images the operator allows"),
    ({"code": CodeBundle(sha256="0" * 64, path="/tmp/x.tar.gz")}, "runs the code its image holds"),
    ({"trainer_package_uri": "s3://b/t.tar.gz"}, "the image holds trainer_pkg"),
    ({"spot": True}, "no spot capacity"),
    ({"procs_per_node": 9}, "at most 8 per node"),
    ({"nodes": 17}, "at most 16 nodes"),
    ({"instance_type": "a100-pool"}, "runs on node pool 'default'"),
    ({"max_runtime_s": 29 * 24 * 3600}, "28 days"),
])
def test_validate_refuses_what_the_cluster_would_refuse(fields, message):
    with pytest.raises(InvalidSpec) as exc:
        backend().validate(spec(**fields))
    assert message in str(exc.value)


def test_processes_per_node_are_bounded_by_the_gpus_with_the_arithmetic():
    with pytest.raises(InvalidSpec) as exc:
        backend(gpus_per_node=2).validate(spec(procs_per_node=4))
    assert str(exc.value) == ("4 processes per node with 2 GPUs per node: each rank needs its own GPU; ask for at "
                              "most 2 (world size 2 × 2 = 4).")
    assert backend(gpus_per_node=4).capabilities.max_procs_per_node == 4
    assert backend().capabilities.max_procs_per_node == 8


def test_settings_report_every_problem_at_once_with_their_labels():
    with pytest.raises(InvalidSpec) as exc:
        KubernetesBackend({
            "kubeconfig": "relative/kubeconfig", "namespace": "Team_A", "runtime": "Torch!", "image": "",
            "gpus_per_node": -1, "cpu_request": "lots", "memory_request": "0", "node_selector": "disk",
            "tolerations": [{"key": "a", "operator": "Sometimes", "colour": "red"}], "service_account": "Bad Name",
            "queue_name": "q_1", "price_provider": "aws", "allowed_images": "ghcr.io/*/x", "bogus": 1,
            "in_cluster": "yes",
        })
    errors = exc.value.errors
    assert errors == {
        "bogus": [errors["bogus"][0]],
        "image": ["Trainer image is required for a Kubernetes (Kubeflow Trainer) backend."],
        "in_cluster": ["In-cluster config: expected true or false, got 'yes'."],
        "gpus_per_node": ["GPUs per node: expected a number from 0 to 64, got -1."],
        "node_selector": ["Node selector: 'disk' is not key=value (e.g. cloud.google.com/gke-nodepool=gpu)."],
        "tolerations": ["Tolerations: toleration 1: unknown field(s) colour (known: key, operator, value, effect, "
                        "tolerationSeconds)."],
        "kubeconfig": ["Kubeconfig file: expected an absolute path, got 'relative/kubeconfig'."],
        "namespace": ["Namespace: 'Team_A' is not a namespace name (at most 63 lowercase letters, digits and '-')."],
        "runtime": ["Training runtime: 'Torch!' is not a runtime name (lowercase letters, digits, '-' and '.')."],
        "service_account": ["Service account: 'Bad Name' is not a service account name (lowercase letters, digits, "
                            "'-' and '.')."],
        "queue_name": ["Kueue queue: 'q_1' is not a LocalQueue name (at most 63 lowercase letters, digits, '-' and "
                       "'.')."],
        "cpu_request": ["CPU request: 'lots' is not a Kubernetes quantity; write a number with an optional suffix: m "
                        "(milli), k, M, G, T or Ki, Mi, Gi, Ti (e.g. 500m, 2, 16Gi)."],
        "memory_request": ["Memory request: '0' requests nothing; leave it blank for no request."],
        "allowed_images": ["Allowed images: 'ghcr.io/*/x' is not an image reference or a prefix ending in * (e.g. "
                           "ghcr.io/acme/train:1.2 or ghcr.io/acme/*)."],
        "price_region": ["Price region: needed too when a node is priced as a cloud instance type (set all three, "
                         "or none for an internal rate)."],
        "price_instance_type": ["Price instance type: needed too when a node is priced as a cloud instance type "
                                "(set all three, or none for an internal rate)."],
    }
    assert errors["bogus"][0].startswith("bogus: unknown Kubernetes setting (known: allowed_images, cluster, context,")


@pytest.mark.parametrize("settings, key, message", [
    ({"kubeconfig": ""}, "kubeconfig", "set the path of a kubeconfig file, or in-cluster config"),
    ({"in_cluster": True}, "in_cluster", "a kubeconfig is set too; use one or the other."),
    ({"image": "ghcr.io/other/t:1"}, "image", "is not among the images the operator allows (ghcr.io/acme/*;"),
    ({"allowed_images": ""}, "image", "allows (none; TRAINBOARD_K8S_ALLOWED_IMAGES)"),
    ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "tolerations", "without a key must have operator Exists"),
    ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}, "tolerations", "Exists takes no value"),
    ({"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]}, "tolerations",
     "tolerationSeconds applies to effect NoExecute only"),
    ({"tolerations": {"key": "k"}}, "tolerations", "expected a list of objects"),
    ({"node_selector": {"bad key!": "v"}}, "node_selector", "a label name is at most 63"),
    ({"node_selector": {"example.com/pool": "a" * 64}}, "node_selector", "is not a label value"),
    ({"node_selector": ["a=b"]}, "node_selector", "expected an object of label key"),
    ({"output_path": "out"}, "output_path", "is not an absolute path"),
])
def test_one_bad_setting_is_named_with_what_to_do(settings, key, message):
    with pytest.raises(InvalidSpec) as exc:
        KubernetesBackend({**BASE, **settings})
    assert list(exc.value.errors) == [key]
    assert message in exc.value.errors[key][0]


def test_settings_are_normalised():
    b = backend(node_selector="a=1,b=2", cpu_request=" 2 ", memory_request="1.5Gi", in_cluster=False,
                tolerations=[{"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                              "tolerationSeconds": 30}])
    assert b.config["node_selector"] == {"a": "1", "b": "2"}
    assert (b.config["cpu_request"], b.config["memory_request"]) == ("2", "1.5Gi")
    assert b.config["tolerations"] == [{"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                                        "tolerationSeconds": 30}]
    assert (b.config["namespace"], b.config["runtime"], b.config["output_path"]) == \
        ("default", "torch-distributed", "/workspace/output")
    in_cluster = KubernetesBackend({"in_cluster": True, "image": "ghcr.io/acme/t:1", "allowed_images": "*"})
    assert in_cluster.config["in_cluster"] is True and "kubeconfig" not in in_cluster.config


def test_prices_an_internal_rate_or_a_cloud_instance_type_and_says_when_none_is_set():
    from decimal import Decimal

    from cloud_adapters.pricing import PriceRow, StaticPriceCatalog

    catalog = StaticPriceCatalog([
        PriceRow("kubernetes", "onprem", "a100", Decimal("0.5"), usd_per_gpu_hour=Decimal("1.25")),
        PriceRow("gcp", "us-central1", "a2-highgpu-2g", Decimal("7.35")),
    ])
    rated = KubernetesBackend({**BASE, "cluster": "onprem", "node_pool": "a100", "gpus_per_node": 2}, prices=catalog)
    assert rated.price() == 3.0 and rated.price_note() == ""  # 0.5 + 2 × 1.25 per node-hour
    unrated = KubernetesBackend({**BASE, "cluster": "onprem", "node_pool": "t4"}, prices=catalog)
    assert unrated.price() == 0.0
    assert unrated.price_note() == ("no internal rate is set for node pool t4 on cluster onprem, so jobs here cost "
                                    "$0; an admin sets it in the price catalog (provider kubernetes, region onprem, "
                                    "instance type t4)")
    cloud = KubernetesBackend({**BASE, "gpus_per_node": 2, "price_provider": "gcp", "price_region": "us-central1",
                               "price_instance_type": "a2-highgpu-2g"}, prices=catalog)
    assert cloud.price() == 7.35 and cloud.price_note() == ""
    with pytest.raises(InvalidSpec, match="no gcp price in the catalog for us-west1"):
        KubernetesBackend({**BASE, "price_provider": "gcp", "price_region": "us-west1",
                           "price_instance_type": "a2-highgpu-2g"}, prices=catalog).price()
    with pytest.raises(InvalidSpec, match="no spot capacity"):
        rated.price(spot=True)
    assert rated.gpus() is None and backend().gpus().count == 0  # GPU memory unknown without an instance type
