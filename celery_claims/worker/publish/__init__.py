"""The publish journal, Celery side: producers journal what they publish, workers recover it.

Reading order: :mod:`.envelope` (what an entry keeps), :mod:`.producer` (journaling each
publish), :mod:`.clearing` (the worker clears the entries of messages gone for good and runs
recovery), :mod:`.recovery` (re-publishing what is neither done nor claimed in time). The
store's side (entries, scripts) is :mod:`celery_claims.claims.journal`.

Why: kombu's Redis transport takes a message off the queue with ``BRPOP`` and records the
delivery in ``unacked`` only afterwards, in a second round trip (``QoS.append``). A consumer
killed in between (SIGKILL, OOM, a paused-then-killed process, a reply lost in a broker
restart) takes the only copy with it: visibility-timeout restore cannot bring back what
``unacked`` never had. Plain Celery has the same hole (kombu #305).

- **Producer** (:class:`ProducerJournal`, set up by ``install(app)``, which runs in producer
  processes too): every message ``app.send_task`` publishes (``apply_async``, ``retry``,
  ``replace``, canvas, beat) is written to the claim store's journal of its queue, keyed by
  the attempt's claim id, with the time after which recovery may act
  (``claims_journal_recover_after_ms`` after the publish, or after the ETA). Where the claim
  store is the Redis broker's server, the publish itself carries it: kombu's push of the
  message to the queue's list and the journal entry are one script, the push first
  (:class:`~celery_claims.worker.transport.publish.PublishRide`). Elsewhere it is written once the
  broker has taken the message, without waiting for the reply: after the publish, not
  before, since a publish that raised must not be re-published behind the caller's back. A
  failed write never fails the publish: it is logged and counted (``journal_write_failed``),
  and for :data:`RETRY_AFTER_S` after it the process does not try again, so an unreachable
  store does not slow every publish.
- **Worker** (:class:`WorkerJournal`, one per worker, driven by the lease keeper's beat): the
  entry of every message the worker acks (done, skipped as done, failed, given up, rejected,
  revoked) is cleared, batched into one pipeline per queue per beat; and every
  ``claims_journal_scan_interval_ms`` it recovers the journal of each queue it consumes
  (:class:`JournalRecovery`): an entry whose recover time has passed is dropped if its task
  is recorded done (or given up), put off if a live claim holds it, and otherwise
  re-published, at most ``claims_journal_max_republish`` times.

Correctness rests on recovery's check, not on the clearing: a stale entry (its clear was lost
with a worker) is found done and dropped. A re-published copy whose first publish was only slow
is a duplicate the claim gate skips (done) or holds (claimed).
"""
