"""Owner strings: one per delivery, never shared between processes or restarts."""

from __future__ import annotations

import os
import warnings

from celery_claims.worker.identity import new_owner


def test_every_owner_of_a_process_is_new_and_names_host_and_pid() -> None:
    owners = [new_owner("w1@host") for _ in range(10_000)]
    assert len(set(owners)) == len(owners)
    host, pid, nonce = owners[0].split("/")
    assert (host, pid) == ("w1@host", str(os.getpid()))
    assert nonce


def test_a_forked_child_draws_a_nonce_of_its_own() -> None:
    before = new_owner("w")
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() while other threads run; the child only writes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report its next owner and leave at once
        os.write(write, new_owner("w").encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0
    after = new_owner("w")
    # the child's counter starts where the parent's was, but its nonce differs
    assert child.split("/")[2][:8] != before.split("/")[2][:8]
    assert after.split("/")[2][:8] == before.split("/")[2][:8]
