"""Bad configuration values are refused with the field, the value and what is allowed."""

import pytest
from pydantic import ValidationError

from dsbd_core import SamplingConfig, config_error_message


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("width", 0, "greater than or equal to 1"),
        ("gamma", 0, "greater than or equal to 1"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("temperature", 0.0, "greater than 0"),
        ("threshold", 1.2, "less than or equal to 1"),
        ("top_k", -1, "greater than or equal to 0"),
        ("mode", "beamy", "with_replacement"),
        ("max_new_tokens", 0, "greater than or equal to 1"),
    ],
)
def test_invalid_field_is_named_with_value_and_allowed_range(
    field: str, value: object, fragment: str
) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingConfig(**{field: value})
    message = config_error_message(info.value)
    assert message.startswith(f"{field}={value!r}")
    assert fragment in message


def test_w_min_larger_than_width_is_refused() -> None:
    with pytest.raises(ValidationError) as info:
        SamplingConfig(width=2, w_min=3)
    message = config_error_message(info.value)
    assert "w_min=3" in message and "width=2" in message


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ValidationError) as info:
        SamplingConfig(beams=3)
    assert "beams" in config_error_message(info.value)


def test_defaults_and_derived_values() -> None:
    cfg = SamplingConfig(width=4)
    # fixed width by default since issue 19 (the fastest setting that keeps beam quality)
    assert cfg.effective_draft_width == 4 and cfg.fixed_width
    assert not SamplingConfig(threshold=0.7).fixed_width
    assert SamplingConfig(width=2, draft_width=5).effective_draft_width == 5
