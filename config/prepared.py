"""Model queries compiled once and run again with other values.

Turning a queryset into SQL is most of what a one-row ORM read costs: `Node.objects.get(pk=...)`
spends ~0.6-1.2 ms of CPU compiling and ~0.25 ms sending the statement and reading its row, on
this project's 2-core VM (docs/benchmarks.md, "Heartbeats"). A path that reads the same rows
on every call (an agent's heartbeat) compiles its queries once here and sends the statement
with the new values after that; the rows become instances exactly as the ORM makes them (the
backend's and the fields' converters, `Model.from_db`), on whatever database the project runs.

    by_prefix = Prepared(lambda prefix: Node.objects.filter(credential_prefix=prefix))
    nodes = by_prefix("3f2a9c")  # [Node]

Each argument must reach the SQL as one parameter, as it was given (an equality or a
comparison; not `__in` with a list, not a lookup that transforms it): `Prepared` checks that
when it compiles. A queryset with select_related, annotations or a values() shape is not
supported (it raises at the first call).
"""

import threading
from collections.abc import Callable

from django.db import connections
from django.db.models import QuerySet
from django.db.transaction import TransactionManagementError

# Stand-ins the build function gets, to find each argument's place among the parameters (an
# int one small enough for a SmallIntegerField: a value out of a field's range compiles to
# nothing).
_SENTINELS = {str: "\x00rigshare-prepared-{}\x00", int: 31_337}


class Prepared:
    def __init__(self, build: Callable[..., QuerySet], *kinds: type):
        """`build(*args)`: the queryset for these arguments; `kinds`: each argument's type
        (str by default, or int), for the stand-in it is compiled with."""
        self.build = build
        self.kinds = kinds
        self._compiled: tuple | None = None
        self._lock = threading.Lock()

    def __call__(self, *args) -> list:
        sql, slots, constants, model, db, init_list, start, end, converters, compiler, \
            for_update = self._compiled or self._compile(len(args))
        params = [args[slot] if slot is not None else constant
                  for slot, constant in zip(slots, constants, strict=True)]
        connection = connections[db]
        if for_update and connection.get_autocommit():
            raise TransactionManagementError("select_for_update cannot be used outside of a "
                                             "transaction.")
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        if converters:
            rows = compiler.apply_converters(rows, converters)
        return [model.from_db(db, init_list, row[start:end]) for row in rows]

    def _compile(self, arity: int) -> tuple:
        with self._lock:
            if self._compiled is not None:
                return self._compiled
            kinds = self.kinds or (str,) * arity
            stand_ins = [_SENTINELS[kind].format(i) if kind is str else _SENTINELS[kind] + i
                         for i, kind in enumerate(kinds)]
            queryset = self.build(*stand_ins)
            query = queryset.query
            if (query.select_related or query.annotations or queryset._fields is not None
                    or queryset._prefetch_related_lookups):
                raise ValueError("Prepared runs plain model querysets only")
            compiler = query.get_compiler(using=queryset.db)
            sql, params = compiler.as_sql()
            slots = [stand_ins.index(p) if p in stand_ins else None for p in params]
            if sorted(s for s in slots if s is not None) != list(range(len(stand_ins))):
                raise ValueError("each argument must reach the SQL as one parameter")
            constants = [None if s is not None else p
                         for s, p in zip(slots, params, strict=True)]
            select, klass_info = compiler.select, compiler.klass_info
            start, end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
            init_list = [column[0].target.attname for column in select[start:end]]
            converters = compiler.get_converters([column[0] for column in select])
            self._compiled = (sql, slots, constants, queryset.model, queryset.db, init_list,
                              start, end, converters, compiler, query.select_for_update)
            return self._compiled
