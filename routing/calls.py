"""The request path's only way to the database: blocking calls (key lookup, reserve, settle,
the pool's rebuild, log batches) run on a small pool of threads, each keeping its own
database connection, so the event loop never waits on I/O it cannot await."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from django.db import InterfaceError, OperationalError, connection

THREADS = 16
_EXECUTOR = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="rigshare-db")
# The usage journal's writes (Redis, or the disk) have threads of their own: a database outage
# that holds every database thread must not hold the record of what was delivered.
_JOURNAL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rigshare-journal")


def _with_fresh_connection(fn, args, kwargs):
    try:
        return fn(*args, **kwargs)
    except (InterfaceError, OperationalError):
        # A connection the server closed (restart, idle timeout) fails once: reconnect and
        # run again. Every call sent this way is idempotent (request ids, reads).
        if connection.in_atomic_block:
            raise
        connection.close()
        return fn(*args, **kwargs)


def start(fn, *args, **kwargs) -> asyncio.Future:
    """The call handed to a thread now, not at the event loop's next turn (as a task calling
    `run` would be): await the future for its result."""
    return asyncio.get_running_loop().run_in_executor(_EXECUTOR, _with_fresh_connection, fn,
                                                      args, kwargs)


async def run(fn, *args, **kwargs):
    return await start(fn, *args, **kwargs)


def journal(fn, *args, **kwargs) -> asyncio.Future:
    """A usage journal call (billing.usage), started now on the journal's threads."""
    return asyncio.get_running_loop().run_in_executor(_JOURNAL, lambda: fn(*args, **kwargs))


def close_connections() -> None:
    """Close every pool thread's database connection (tests drop their database after)."""
    import threading

    barrier = threading.Barrier(THREADS)

    def close():
        barrier.wait(timeout=10)  # one task per thread: each closes its own connection
        connection.close()

    for future in [_EXECUTOR.submit(close) for _ in range(THREADS)]:
        future.result()
