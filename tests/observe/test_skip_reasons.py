"""The skip reasons are one enum, each with its own meaning and its own ``inspect`` wording,
and docs/testing.md lists them as the code has them."""

from __future__ import annotations

from pathlib import Path

from celery_claims.observe import SKIP_REASONS, SKIP_WORDING, HistoryEvent, SkipReason
from celery_claims.observe.history import skip_reasons_reference
from celery_claims.observe.render import event_text
from celery_claims.reference import main

ROOT = Path(__file__).resolve().parents[2]


def _event(reason: SkipReason) -> HistoryEvent:
    return HistoryEvent(1, "skipped", reason.value, "w@host", "q/t['k']", "other", 3)


def test_every_skip_reason_has_a_wording_and_a_meaning_and_nothing_else_has() -> None:
    assert set(SKIP_WORDING) == set(SkipReason)
    assert set(SKIP_REASONS) == set(SkipReason)


def test_no_two_skip_reasons_share_a_wording() -> None:
    wordings = list(SKIP_WORDING.values())
    told = [event_text(_event(reason)) for reason in SkipReason]

    assert len(set(wordings)) == len(wordings)
    assert len(set(told)) == len(told)


def test_only_a_copy_of_a_finished_attempt_reads_already_done() -> None:
    told = {reason: event_text(_event(reason)) for reason in SkipReason}

    assert [r for r, text in told.items() if "already done" in text] == [SkipReason.DONE]
    for reason in (SkipReason.KEY_HELD, SkipReason.KEY_RESCHEDULED, SkipReason.KEY_DONE):
        assert "task other" in told[reason]
        assert "key t['k']" in told[reason]


def test_a_reason_this_reader_does_not_know_is_shown_as_given() -> None:
    event = HistoryEvent(1, "skipped", "from_the_future", "w@host", "q/t:0:0", "someone")

    assert event_text(event) == ("copy acked without running on w@host: from_the_future (someone)")


def test_skip_reasons_are_str_values_equal_to_what_the_signal_carries() -> None:
    assert SkipReason.DONE == "done"
    assert SkipReason("key_held") is SkipReason.KEY_HELD
    assert str(SkipReason.KEY_DONE) == "key_done"


def test_docs_testing_md_lists_the_skip_reasons_as_the_code_has_them() -> None:
    docs = (ROOT / "docs" / "testing.md").read_text()

    assert skip_reasons_reference() in docs, (
        "docs/testing.md's list of skip reasons differs from celery_claims/observe/history.py: "
        "regenerate it with `python -m celery_claims.reference`"
    )


def test_python_m_celery_claims_reference_rewrites_a_drifted_list(tmp_path: Path) -> None:
    # Given a copy of the docs whose list of skip reasons lacks a row
    (tmp_path / "docs").mkdir()
    for name in ("settings.md", "testing.md"):
        (tmp_path / "docs" / name).write_text((ROOT / "docs" / name).read_text())
    testing = tmp_path / "docs" / "testing.md"
    row = next(line for line in testing.read_text().splitlines() if line.startswith("| `key_done`"))
    testing.write_text(testing.read_text().replace(row + "\n", ""))

    # When the generator runs, twice
    first, second = main(tmp_path), main(tmp_path)

    # Then it puts the row back, and then finds nothing to do
    assert first == ["docs/settings.md: up to date", "docs/testing.md: updated"]
    assert second == ["docs/settings.md: up to date", "docs/testing.md: up to date"]
    assert skip_reasons_reference() in testing.read_text()
