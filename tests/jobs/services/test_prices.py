"""jobs/services/prices.py: the catalog's writes (one transaction; a bad row names itself)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError

from cloud_adapters.pricing import PriceRow
from jobs import services
from jobs.models import InstancePrice

pytestmark = pytest.mark.django_db


def test_upsert_refuses_a_bad_row_and_writes_nothing():
    rows = [PriceRow("aws", "us-east-1", "ml.ok", Decimal("1.0")),
            PriceRow("aws", "us-east-1", "ml.bad", Decimal("-1")),
            PriceRow("ibm", "dal10", "bx2", Decimal("1.0"), as_of="yesterday")]
    with pytest.raises(ValidationError) as caught:
        services.instance_price_upsert(rows=rows)
    errors = caught.value.message_dict
    assert errors["usd_per_hour"] == ["aws us-east-1 ml.bad: USD per hour must be a number ≥ 0, got Decimal('-1')."]
    assert errors["provider"] == ["ibm dal10 bx2: provider must be one of aws, gcp, azure, slurm, kubernetes, ray, got 'ibm'."]
    assert errors["as_of"] == ["ibm dal10 bx2: as_of 'yesterday' is not a date (YYYY-MM-DD)."]
    assert InstancePrice.objects.count() == 0
