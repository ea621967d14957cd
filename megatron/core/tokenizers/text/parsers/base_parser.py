"""The interface of a text parser: ``parse(text, **kwargs)`` returns the text left for the user and a dict of what
was taken out of it."""

from typing import Any


class BaseParser:
    """Leaves the text as it is and extracts nothing; subclasses override ``parse``."""

    @staticmethod
    def parse(text: str, **kwargs) -> tuple[str, dict[str, Any]]:
        return text, {}
