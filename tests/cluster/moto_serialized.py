"""moto's server with its SQS backend's calls one at a time (tests/cluster/sqs.sh runs it).

moto_server answers each request on a thread of its own, and moto's SQS backend (5.2.5)
takes no lock around its queues' state: two concurrent ReceiveMessage calls can both see
a message visible and both hand it out (one with receive count 2 while it is in flight),
and a DeleteMessage rebuilds the queue's message list from the one it started with, so a
concurrent delete's work is undone (its message, deleted, comes back after its visibility
timeout) and a concurrent send can be lost. SQS does neither. Seen in the two-replica
tests' recorder (sqs.rs, `explain`) as redeliveries no heartbeat could prevent.

Every public method of the SQS backend runs under one lock here, released while a long
poll waits for messages (the wait happens inside ReceiveMessage, between its passes over
the queue), so the backend sees one call at a time, as a single-threaded queue would, and
a long poll blocks no other call. Arguments are moto_server's.
"""

import functools
import threading

from moto.server import main
from moto.sqs import models

_lock = threading.Lock()
_held = threading.local()


def _serialized(method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        # A backend method calling another (delete_message_batch -> delete_message) is
        # already under the lock.
        if getattr(_held, "depth", 0):
            _held.depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                _held.depth -= 1
        with _lock:
            _held.depth = 1
            try:
                return method(*args, **kwargs)
            finally:
                _held.depth = 0

    return call


for _name, _method in list(vars(models.SQSBackend).items()):
    if callable(_method) and not _name.startswith("_"):
        setattr(models.SQSBackend, _name, _serialized(_method))

_wait_for_messages = models.Queue.wait_for_messages


def _wait_unlocked(self, timeout):
    """A long poll's wait, with the lock let go so that the send it waits for can run."""
    depth = getattr(_held, "depth", 0)
    if not depth:
        return _wait_for_messages(self, timeout)
    _held.depth = 0
    _lock.release()
    try:
        return _wait_for_messages(self, timeout)
    finally:
        _lock.acquire()
        _held.depth = depth


models.Queue.wait_for_messages = _wait_unlocked

if __name__ == "__main__":
    main()
