"""config/prepared.py: a query compiled once gives, for other values, what the ORM gives."""

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError

from config.prepared import Prepared
from marketplace.models import Card, Node
from tests.factories import CardFactory, NodeFactory

pytestmark = pytest.mark.django_db


def fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields}


def test_rows_for_other_values_are_the_orms_rows_converters_included():
    nodes = [NodeFactory(engine_models=[f"m{i}"], engine_versions={"vllm": f"0.{i}"})
             for i in range(3)]
    by_prefix = Prepared(lambda prefix: Node.objects.filter(credential_prefix=prefix).order_by())
    for node in nodes:
        (found,) = by_prefix(node.credential_prefix)
        assert fields(found) == fields(Node.objects.get(pk=node.pk))
        assert found.engine_versions == node.engine_versions  # JSON, decoded as the ORM does
        assert found._state.adding is False and found._state.db == "default"
    assert by_prefix("no-such-prefix") == []


def test_constants_and_several_arguments_keep_their_places():
    node = NodeFactory()
    cards = [CardFactory(node=node, index=i) for i in range(3)]
    some = Prepared(lambda node_id, index: Card.objects.filter(
        node_id=node_id, index__gte=index, present=True).order_by("index"), int, int)
    assert [c.pk for c in some(node.pk, 1)] == [c.pk for c in cards[1:]]
    assert [c.pk for c in some(node.pk, 0)] == [c.pk for c in cards]
    Card.objects.filter(pk=cards[2].pk).update(present=False)
    assert [c.pk for c in some(node.pk, 1)] == [cards[1].pk]


def test_deferred_columns_load_when_read():
    node = NodeFactory(hostname="box-7")
    few = Prepared(lambda pk: Node.objects.filter(pk=pk).only("pk", "status"), int)
    (found,) = few(node.pk)
    assert found.get_deferred_fields() and found.hostname == "box-7"


@pytest.mark.django_db(transaction=True)
def test_a_lock_outside_a_transaction_is_refused_as_the_orm_refuses_it():
    node = NodeFactory()
    locked = Prepared(lambda pk: Node.objects.select_for_update().filter(pk=pk), int)
    with pytest.raises(TransactionManagementError):
        locked(node.pk)
    with transaction.atomic():
        assert [n.pk for n in locked(node.pk)] == [node.pk]


def test_an_argument_that_does_not_reach_the_sql_as_one_parameter_is_refused():
    with pytest.raises(ValueError, match="one parameter"):
        Prepared(lambda name: Node.objects.filter(hostname__contains=name))("box")
    with pytest.raises(ValueError, match="plain model querysets"):
        Prepared(lambda pk: Node.objects.filter(pk=pk).values("pk"), int)(1)
