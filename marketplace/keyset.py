"""Keyset pagination for the catalog: each page starts after the last row of the one before,
found through an index on the sort key plus the card's id, never by counting rows from the
start (OFFSET walks every row it skips: page 400 of a 100,000-card catalog read 10,000 rows).

A cursor is an opaque token naming the sort it belongs to, the direction (the page after or
before a row) and that row's key values. The page and /api/cards/ share it.
"""

import base64
import binascii
import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from django.db.models import BooleanField, Expression, F, Value
from django.db.models.functions import Coalesce


class InvalidCursor(ValueError):
    """The cursor is malformed, tampered with, or belongs to another sort."""


class RowCompare(Expression):
    """`(a, b, c) > (x, y, z)` (or `<`, `>=`, `<=`): the row comparison a btree index on
    (a, b, c) answers by seeking straight to the row after (x, y, z), ties on `a` included.
    PostgreSQL and SQLite (3.15+) both compare rows this way."""

    conditional = True
    output_field = BooleanField()

    def __init__(self, keys, op: str, values):
        if op not in (">", "<", ">=", "<="):
            raise ValueError(op)
        super().__init__()
        self.keys, self.op, self.values = list(keys), op, list(values)

    def get_source_expressions(self):
        return self.keys

    def set_source_expressions(self, exprs):
        self.keys = list(exprs)

    def as_sql(self, compiler, connection):
        parts, params = [], []
        for key in self.keys:
            sql, key_params = compiler.compile(key)
            parts.append(sql)
            params.extend(key_params)
        placeholders = ", ".join(["%s"] * len(self.values))
        return f"({', '.join(parts)}) {self.op} ({placeholders})", [*params, *self.values]


@dataclass(frozen=True)
class Key:
    expression: object  # a Django expression on Card
    kind: type  # int, Decimal or float: what a cursor's value must parse as


@dataclass(frozen=True)
class Order:
    """A catalog sort: its keys, ascending, the last one unique (the tie-break); every key runs
    in the same direction so that one index read forwards or backwards serves both ways."""

    keys: tuple[Key, ...]
    descending: bool = False
    # How many leading keys one index holds (the rest live in another table): those get a
    # bound of their own, which the planner can start an index scan from.
    indexed: int = 0

    def aliases(self) -> dict[str, object]:
        return {f"_key{i}": key.expression for i, key in enumerate(self.keys)}

    def ordering(self, *, backwards: bool = False) -> list:
        descending = self.descending != backwards
        return [F(alias).desc() if descending else F(alias).asc() for alias in self.aliases()]

    def after(self, values: list, *, backwards: bool = False) -> list[Expression]:
        """Conditions for the rows after `values` in this order (before them: `backwards`)."""
        op = "<" if self.descending != backwards else ">"
        exprs = [key.expression for key in self.keys]
        conditions = [RowCompare(exprs, op, values)]
        if 0 < self.indexed < len(self.keys):
            # Implied by the comparison above; said again so that the index holding the
            # leading keys can start its scan at the right place.
            conditions.append(RowCompare(exprs[:self.indexed], op + "=", values[:self.indexed]))
        return conditions

    def values_of(self, row) -> list:
        return [getattr(row, alias) for alias in self.aliases()]


def coalesced(field: str, empty, output_field) -> Coalesce:
    """A nullable key as an index can order it: an unknown value sorts as `empty`."""
    return Coalesce(F(field), Value(empty), output_field=output_field)


def encode(sort: str, backwards: bool, values: list) -> str:
    plain = [str(v) if isinstance(v, Decimal) else v for v in values]
    data = json.dumps([sort, "p" if backwards else "n", plain], separators=(",", ":"))
    return base64.urlsafe_b64encode(data.encode()).decode().rstrip("=")


def decode(token: str, sort: str, order: Order) -> tuple[bool, list]:
    """(backwards, values) of a cursor made by encode() for this sort; InvalidCursor else."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        name, direction, values = json.loads(raw)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise InvalidCursor("This page link is malformed.") from None
    if name != sort:
        raise InvalidCursor("This page link belongs to another sort order.")
    if direction not in ("n", "p") or not isinstance(values, list) \
            or len(values) != len(order.keys):
        raise InvalidCursor("This page link is malformed.")
    return direction == "p", [_parse(value, key.kind) for value, key in
                              zip(values, order.keys, strict=True)]


def _parse(value, kind: type):
    if kind is int and isinstance(value, int) and not isinstance(value, bool) \
            and abs(value) < 2**63:
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is Decimal and isinstance(value, str):
        try:
            number = Decimal(value)
        except InvalidOperation:
            number = None
        if number is not None and number.is_finite():
            return number
    raise InvalidCursor("This page link is malformed.")

