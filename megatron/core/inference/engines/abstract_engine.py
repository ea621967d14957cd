"""What an inference engine offers: generate text for prompts."""

from abc import ABC, abstractmethod
from typing import List


class AbstractEngine(ABC):
    @abstractmethod
    def generate(self, *args, **kwargs) -> List:
        """Generate for the given prompts and return the finished requests."""
