"""The Prometheus exporter, scraped over HTTP from real workers and from ``celery-claims``."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli.conftest import QUEUE, LiveFleet
from tests.servers import free_port
from tests.worker.helpers import wait_for

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``http://127.0.0.1:port/metrics``, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]], name: str,
          **labels: str) -> float:  # fmt: skip
    """The sum of ``name`` over workers, for samples that carry ``labels``."""
    return sum(
        value
        for scraped in samples
        for (sample, sample_labels), value in scraped.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def test_each_worker_exports_its_claims_skips_holds_renewals_and_live_claims(
    live_fleet: LiveFleet,
) -> None:
    # Given the fleet ran done-1 and a skipped copy of it, and runs live-1 with a held copy
    # When both workers' exporters are scraped
    scraped = [scrape(port) for port in live_fleet.metrics_ports]

    # Then, summed over the fleet, the counters tell what the gate did
    assert total(scraped, "celery_claims_claims_total", result="acquired") == 2
    assert total(scraped, "celery_claims_skipped_copies_total", reason="done") == 1
    assert total(scraped, "celery_claims_skipped_copies_total", reason="held") == 1
    assert total(scraped, "celery_claims_contentions_total") == 1
    assert total(scraped, "celery_claims_takeovers_total") == 0
    assert total(scraped, "celery_claims_lease_losses_total") == 0
    assert total(scraped, "celery_claims_completions_total", result="done") == 1
    assert total(scraped, "celery_claims_worker_live_claims") == 1
    assert total(scraped, "celery_claims_worker_held_copies") == 1
    # and the lease keeper renews live-1 every 500 ms (the first renewal may come after the
    # first scrape on a busy machine: scraped again until it shows)
    wait_for(
        lambda: (
            total([scrape(p) for p in live_fleet.metrics_ports], "celery_claims_renewals_total")
            >= 1
        ),
        timeout=5,
        what="a renewal",
    )
    # and the publish journal's recovery found nothing lost (each event is exported)
    for event in ("written", "write_failed", "republished", "dropped", "cleared", "deferred"):
        assert all(
            ("celery_claims_journal_total", (("event", event), ("worker", worker))) in one
            for one in scraped
            for worker in {dict(labels).get("worker") for _, labels in one} - {None}
        ), event
    assert total(scraped, "celery_claims_journal_total", event="republished") == 0
    # and the task history's writer dropped nothing (the store was up)
    for one in scraped:
        dropped = [
            v for (sample, _), v in one.items() if sample == "celery_claims_events_dropped_total"
        ]
        assert dropped == [0]
    # each worker also exports the fleet-wide view of the claim store
    for one in scraped:
        assert one[("celery_claims_store_up", ())] == 1
        assert one[("celery_claims_live_claims", (("queue", QUEUE),))] == 1


def test_renewals_keep_counting_between_scrapes(live_fleet: LiveFleet) -> None:
    def renewals() -> float:
        return total([scrape(p) for p in live_fleet.metrics_ports], "celery_claims_renewals_total")

    first = renewals()

    wait_for(lambda: renewals() > first, timeout=5, what="another renewal")


def test_the_standalone_exporter_serves_the_store_view_over_http(
    live_fleet: LiveFleet,
) -> None:
    # Given `celery-claims metrics` serving the fleet's claim store
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_claims.cli", "--redis-url", live_fleet.url,
         "--prefix", live_fleet.ns, "metrics", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # When it is scraped
        scraped = wait_for(lambda: _try_scrape(port), timeout=20, what="the exporter")

        # Then it shows the queue's counters and live claims
        assert scraped[("celery_claims_store_up", ())] == 1
        assert scraped[("celery_claims_live_claims", (("queue", QUEUE),))] == 1
        assert scraped[("celery_claims_store_successes_total", (("queue", QUEUE),))] >= 2
        assert scraped[("celery_claims_store_contentions_total", (("queue", QUEUE),))] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


def _try_scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    try:
        return scrape(port)
    except OSError:
        return None


def test_a_scrape_while_the_store_is_down_answers_with_store_up_0() -> None:
    # Given a store collector whose Redis does not listen
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from celery_claims import RedisClaimManager
    from celery_claims.metrics import StoreCollector

    manager = RedisClaimManager(url=f"redis://127.0.0.1:{free_port()}/0")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(manager))

    # When it is scraped
    text = generate_latest(registry).decode()

    # Then the scrape succeeds and says the store is down, and nothing else
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples == ["celery_claims_store_up 0.0"]
    manager.client.close()


def test_the_collectors_refuse_what_is_not_a_store_or_a_worker_runtime() -> None:
    from celery_claims import InvalidArgument
    from celery_claims.metrics import StoreCollector, WorkerCollector

    with pytest.raises(InvalidArgument, match="manager"):
        StoreCollector("redis://localhost")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"worker\.claims"):
        WorkerCollector(object())
