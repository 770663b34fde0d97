"""The refusal every translation raises, and the shape checks that raise it naming the field."""

from __future__ import annotations

from typing import Any


class TranslationError(ValueError):
    """A request or response that the other wire format cannot express; `param` names the field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _dict(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TranslationError(f"'{param}' must be an object", param=param)
    return value


def _list(value: object, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise TranslationError(f"'{param}' must be an array", param=param)
    return value


def _str(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise TranslationError(f"'{param}' must be a string", param=param)
    return value


def _parse_data_url(url: str, param: str) -> tuple[str, str]:
    """`data:<media type>;base64,<data>` → (media type, base64 data)."""
    header, comma, data = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not comma or encoding != "base64" or not media_type:
        raise TranslationError(f"'{param}' must be a base64 data URL", param=param)
    return media_type, data


def optional_str(item: dict[str, Any], key: str, where: str) -> str:
    """`item[key]` when a string, "" when absent or null; any other type is refused."""
    value = item.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TranslationError(f"'{where}.{key}' must be a string", param=f"{where}.{key}")
    return value


def required_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise TranslationError(
            f"'{where}.{key}' must be a non-empty string", param=f"{where}.{key}"
        )
    return value


def typed(item: dict[str, Any], key: str, kind: type, expected: str, where: str) -> None:
    """Refuse `item[key]` when present, not null and not of the JSON type `kind`."""
    value = item.get(key)
    if value is not None and not isinstance(value, kind):
        raise TranslationError(f"'{where}.{key}' must be {expected}", param=f"{where}.{key}")
