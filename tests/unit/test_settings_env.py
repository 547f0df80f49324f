"""The environment readers of config/settings.py: a value Holdfast cannot use is refused
(ImproperlyConfigured: one line and exit 2 from every command), never guessed."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from config.settings import env_bool, env_number


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_a_number_setting_must_be_finite(monkeypatch, value):
    monkeypatch.setenv("HOLDFAST_POLL_SECONDS", value)
    with pytest.raises(ImproperlyConfigured, match="HOLDFAST_POLL_SECONDS must be a finite"):
        env_number("HOLDFAST_POLL_SECONDS", 1)


@pytest.mark.parametrize("value", ["ture", "maybe", "2", "enabled"])
def test_a_flag_with_an_unknown_word_is_refused(monkeypatch, value):
    monkeypatch.setenv("HOLDFAST_BEHIND_TLS_PROXY", value)
    with pytest.raises(ImproperlyConfigured, match="HOLDFAST_BEHIND_TLS_PROXY must be"):
        env_bool("HOLDFAST_BEHIND_TLS_PROXY")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("Yes", True), (" on ", True), ("0", False), ("off", False), ("", None)],
)
def test_flags_read_the_usual_words(monkeypatch, value, expected):
    monkeypatch.setenv("DJANGO_DEBUG", value)
    default = object()
    assert env_bool("DJANGO_DEBUG", default) is (default if expected is None else expected)  # type: ignore[arg-type]
