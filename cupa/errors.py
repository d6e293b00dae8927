"""The one exception type cupa raises for bad input."""


class PagedAttentionError(ValueError):
    """An input, output or attribute violates the PagedAttention contract.

    The message names the offending input or attribute, what it got and what it
    expected. It is a ``ValueError`` so generic input-checking code catches it.
    """


def fail(name: str, got, expected: str) -> "PagedAttentionError":
    """Build the error for input/attribute ``name``: ``got`` is what was seen."""
    return PagedAttentionError(f"{name}: got {got}; expected {expected}")
