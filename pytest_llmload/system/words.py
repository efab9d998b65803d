"""Words in the messages the tool writes about a user's values: "an int", "a dict"."""

from typing import Any


def a(noun: str) -> str:
    """``noun`` with its indefinite article, by its first letter (good enough for type and field names)."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def a_type(value: Any) -> str:
    """The type of ``value`` with its article: ``a_type(3)`` is ``"an int"``."""
    return a(type(value).__name__)
