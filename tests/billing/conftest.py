"""What the metering tests share: the price in force and the worker that served."""

from datetime import timedelta

import pytest

from billing.metering import Worker
from billing.models import ModelPrice
from tests.billing.test_metering import IN_PER_MTOK, MODEL, OUT_PER_MTOK, T0


@pytest.fixture(autouse=True)
def _fee(settings):
    settings.RIGSHARE_PLATFORM_FEE_BPS = 1500


@pytest.fixture
def price(db):
    return ModelPrice.objects.create(model=MODEL, input_micros_per_mtok=IN_PER_MTOK,
                                     output_micros_per_mtok=OUT_PER_MTOK,
                                     effective_at=T0 - timedelta(days=1))


@pytest.fixture
def worker(bob):
    return Worker(provider_id=bob.pk, reference="card:7")
