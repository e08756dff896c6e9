"""SageMakerBackend settings, validation, prices, names, the registry entry and test_connection."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from cloud_adapters import registry
from cloud_adapters.base import InvalidSpec, JobSpec
from cloud_adapters.pricing import PriceRow, StaticPriceCatalog
from cloud_adapters.sagemaker import SageMakerBackend
from cloud_adapters.sagemaker.backend import NAME_RE, hyperparameters, training_job_name
from sagemaker_standin import BUCKET, ROLE, make_backend

REPO = Path(__file__).resolve().parents[3]
BASE = {"region": "us-east-1", "role_arn": ROLE, "bucket": BUCKET}


def test_defaults():
    cfg = SageMakerBackend(BASE).config
    assert cfg == {
        "region": "us-east-1", "role_arn": ROLE, "bucket": BUCKET, "prefix": "trainboard",
        "image_uri": "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312",
        "instance_type": "ml.g5.xlarge", "spot_allowed": False, "profile": "", "endpoint_url": "",
        "max_nodes": 8, "max_procs_per_node": 8, "volume_size_gb": 50, "max_calls_per_second": 10.0,
    }
    caps = SageMakerBackend(dict(BASE, spot_allowed=True)).capabilities
    assert (caps.spot, caps.max_nodes, caps.strategies) == (True, 8, ("ddp", "fsdp", "pipeline"))
    assert SageMakerBackend(BASE).capabilities.spot is False


@pytest.mark.parametrize("change, key, message", [
    ({"region": "US East"}, "region", "AWS region: expected an AWS region code such as 'us-east-1', got 'US East'."),
    ({"role_arn": "SageMakerRole"}, "role_arn",
     "Execution role ARN: expected an IAM role ARN 'arn:aws:iam::<12-digit account id>:role/<name>'"),
    ({"role_arn": "arn:aws:iam::1234:role/x"}, "role_arn", "Execution role ARN: expected an IAM role ARN"),
    ({"bucket": "s3://my-bucket"}, "bucket", "S3 bucket: expected an S3 bucket name"),
    ({"bucket": None}, "bucket", "S3 bucket is required for an AWS SageMaker backend."),
    ({"role_arn": " "}, "role_arn", "Execution role ARN is required for an AWS SageMaker backend."),
    ({"region": "ap-south-2"}, "image_uri",
     "Training image: no default PyTorch training image is known for region 'ap-south-2'"),
    ({"instance_type": "g5.xlarge"}, "instance_type",
     "Default instance type: expected a SageMaker 'ml.*' instance type"),
    ({"spot_allowed": "yes"}, "spot_allowed", "Spot allowed: expected true or false, got 'yes'."),
    ({"max_nodes": 0}, "max_nodes", "max_nodes: expected an integer from 1 to 100, got 0."),  # no form field
    ({"endpoint_url": "localhost:5000"}, "endpoint_url", "endpoint_url: expected an http(s):// URL"),
    ({"aws_secret_access_key": "x"}, "aws_secret_access_key", "aws_secret_access_key: unknown SageMaker setting"),
])
def test_bad_settings_name_the_field(change, key, message):
    """Each problem is keyed by its setting and worded with the form's label for it, so the form shows
    it on the field the user sees."""
    with pytest.raises(InvalidSpec) as err:
        SageMakerBackend({**BASE, **change})
    assert list(err.value.errors) == [key]
    assert err.value.errors[key][0].startswith(message)
    assert str(err.value).startswith(message)


def test_every_bad_setting_is_reported_at_once():
    """An empty form gets every problem in one answer, not region, then its format, then the ARN, one
    per submit."""
    with pytest.raises(InvalidSpec) as err:
        SageMakerBackend({"region": "", "role_arn": "", "bucket": "", "instance_type": "g5", "spot_allowed": "no"})
    assert err.value.errors == {
        "region": ["AWS region is required for an AWS SageMaker backend."],
        "role_arn": ["Execution role ARN is required for an AWS SageMaker backend."],
        "bucket": ["S3 bucket is required for an AWS SageMaker backend."],
        "instance_type": ["Default instance type: expected a SageMaker 'ml.*' instance type, got 'g5'."],
        "spot_allowed": ["Spot allowed: expected true or false, got 'no'."],
    }
    with pytest.raises(InvalidSpec) as err:
        SageMakerBackend({**BASE, "region": "US East", "role_arn": "SageMakerRole"})
    assert list(err.value.errors) == ["region", "role_arn"]  # the region's format and the ARN together


def test_explicit_image_and_other_region():
    cfg = SageMakerBackend({**BASE, "region": "ap-south-2", "image_uri": "123.dkr.ecr.ap-south-2.amazonaws.com/x:1"}).config
    assert cfg["image_uri"] == "123.dkr.ecr.ap-south-2.amazonaws.com/x:1"
    assert SageMakerBackend({**BASE, "region": "eu-west-1"}).config["image_uri"] == \
        "763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:2.8.0-gpu-py312"


def test_registry_entry():
    assert registry.backend_class("sagemaker") is SageMakerBackend
    assert ("sagemaker", "AWS SageMaker") in registry.kind_choices()
    assert registry.EXTRAS["sagemaker"] == "aws"


def test_missing_boto3_names_the_aws_extra():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('boto3', 'botocore'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from cloud_adapters import registry\n"
        "from cloud_adapters.base import MissingDependency\n"
        "try:\n"
        "    registry.backend_class('sagemaker')\n"
        "except MissingDependency as exc:\n"
        "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    message = out.stdout.strip()
    assert message.startswith("the AWS SageMaker backend needs a package that is not installed (boto3); "
                              "install boto3 "), (message, out.stderr)


@pytest.mark.parametrize("name, expected", [
    ("tb-job-12-67a1b2c3", "tb-job-12-67a1b2c3"),
    ("tb_job_12", "tb-job-12-" + __import__("hashlib").sha256(b"tb_job_12").hexdigest()[:8]),
    ("-x-", "x-" + __import__("hashlib").sha256(b"-x-").hexdigest()[:8]),
    ("a" * 70, "a" * 54 + "-" + __import__("hashlib").sha256(b"a" * 70).hexdigest()[:8]),
])
def test_training_job_names(name, expected):
    assert training_job_name(name) == expected
    assert NAME_RE.fullmatch(expected) and len(expected) <= 63
    assert training_job_name("tb_job_12") != training_job_name("tb-job-12")


def test_hyperparameters_are_json_strings_without_the_output_directories():
    hps = hyperparameters({"train": {"epochs": 2, "augment": True, "lr": 0.1}, "data": {"name": "digits"},
                           "model": {"params": {"hidden_size": 8}},
                           "output": {"output_dir": "x", "checkpoint_dir": "", "checkpoint_format": "sharded"}})
    # SageMaker's /opt/ml/model and /opt/ml/checkpoints replace the directories; the format is the job's.
    assert hps == {"train.epochs": "2", "train.augment": "true", "train.lr": "0.1", "data.name": '"digits"',
                   "model.params": '{"hidden_size":8}', "output.checkpoint_format": '"sharded"'}
    with pytest.raises(InvalidSpec, match="config.data.uri: 2502 characters as a SageMaker hyperparameter, the limit is 2500"):
        hyperparameters({"data": {"uri": "x" * 2500}})


def spec(**kw) -> JobSpec:
    values = dict(job_name="tb-job-1-a", config={"train": {"epochs": 1}}, nodes=2, procs_per_node=1,
                  instance_type="ml.g5.xlarge", max_runtime_s=3600)
    values.update(kw)
    return JobSpec(**values)


@pytest.mark.parametrize("change, message", [
    ({"instance_type": "ml.z9.huge"}, "instance type 'ml.z9.huge' has no price in the catalog for us-east-1; known: "
                                      "ml.g5.12xlarge, ml.g5.xlarge, ml.m5.xlarge, ml.p3.2xlarge, ml.p4d.24xlarge."),
    ({"instance_type": "n1-standard-8"}, "instance type 'n1-standard-8': SageMaker training types start with 'ml.'"),
    ({"procs_per_node": 2}, "2 × ml.g5.xlarge with 2 processes per node: ml.g5.xlarge has 1 GPU and each rank needs "
                            "its own; ask for at most 1 processes per node (world size 2 × 1 = 2)."),
    ({"instance_type": "ml.m5.xlarge", "procs_per_node": 6}, "ml.m5.xlarge has 4 vCPUs; ask for at most 4"),
    ({"nodes": 9}, "9 nodes requested, but this backend runs at most 8 nodes per job."),
    ({"max_runtime_s": 28 * 86400 + 1}, "max runtime 2419201 s is above SageMaker's limit of 2419200 s (28 days)"),
    ({"dataset_uri": "/data/digits"}, "dataset '/data/digits': SageMaker reads data from S3"),
    ({"tags": {"bad!": "x"}}, "tag 'bad!'='x': keys 1–128"),
    ({"env": {"1BAD": "x"}}, "env '1BAD': names are letters"),
])
def test_validate_rejects_with_the_arithmetic(change, message):
    with pytest.raises(InvalidSpec) as err:
        make_backend(spot_allowed=False).validate(spec(**change))
    assert str(err.value).startswith(message)


def test_spot_only_when_allowed():
    with pytest.raises(InvalidSpec, match="no spot capacity"):
        make_backend(spot_allowed=False).validate(spec(spot=True))
    make_backend(spot_allowed=True).validate(spec(spot=True))
    make_backend().validate(spec(instance_type="ml.g5.12xlarge", procs_per_node=4, max_runtime_s=28 * 86400))


def test_prices_and_offers_come_from_the_catalog():
    backend = make_backend()
    assert backend.price("ml.g5.xlarge") == 1.4084 and backend.price() == 1.4084
    assert backend.price("ml.g5.xlarge", spot=True) == 1.4084  # billable seconds carry the spot saving
    offers = backend.instance_offers()
    assert [(o.instance_type, o.usd_per_hour, o.confirmed) for o in offers] == [
        ("ml.g5.12xlarge", 7.09, False), ("ml.g5.xlarge", 1.4084, False), ("ml.m5.xlarge", 0.23, False),
        ("ml.p3.2xlarge", 3.825, False), ("ml.p4d.24xlarge", 37.688, False)]
    assert offers[0].source.startswith("aws-samples/foundation-model-benchmarking-tool") and "(2025-01-26)" in offers[0].source
    with pytest.raises(InvalidSpec, match="known: ml.g5.12xlarge, ml.g5.xlarge"):
        backend.price("ml.c5.xlarge")

    own = StaticPriceCatalog([PriceRow("aws", "us-east-1", "ml.c5.xlarge", Decimal("0.2"))])
    mine = SageMakerBackend({**BASE}, prices=own)
    assert mine.price("ml.c5.xlarge") == 0.2 and [o.instance_type for o in mine.instance_offers()] == ["ml.c5.xlarge"]
    assert make_backend(region="us-west-2").instance_offers() == []


# -- test_connection ----------------------------------------------------------------------------


def test_connection_all_good():
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        checks = make_backend().test_connection()
    assert [(c.name, c.ok) for c in checks] == [("identity", True), ("bucket", True), ("SageMaker access", True)]
    assert checks[0].message == "signed in as arn:aws:sts::123456789012:user/moto (account 123456789012)"
    assert checks[1].message == f"bucket {BUCKET} exists and is accessible"
    assert checks[2].message == "SageMaker API reachable in us-east-1 (ListTrainingJobs allowed)"


def test_connection_missing_bucket():
    with mock_aws():
        checks = make_backend().test_connection()
    assert [(c.name, c.ok) for c in checks] == [("identity", True), ("bucket", False), ("SageMaker access", True)]
    assert checks[1].message == f"bucket {BUCKET} does not exist; create it in us-east-1 or correct the bucket setting."


def test_connection_without_credentials(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    checks = make_backend().test_connection()  # no request leaves: signing fails first
    assert [c.ok for c in checks] == [False, False, False]
    assert checks[0].message.startswith("no AWS credentials found: set AWS_PROFILE (or this backend's profile) or "
                                        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")


def test_connection_unknown_profile():
    checks = make_backend(profile="nope").test_connection()
    assert [c.ok for c in checks] == [False, False, False]
    assert "The config profile (nope) could not be found" in checks[0].message
    assert "set the backend's profile to a profile in ~/.aws/config" in checks[0].message
