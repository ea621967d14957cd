"""Generated token ids -> text pieces that are safe to send, with stop sequences cut out.

A streamed piece must never be taken back, so :class:`TextStream` holds back two kinds of tail until the next
token settles them: an incomplete UTF-8 character (a byte-level BPE token can end mid-character; the decoder then
shows U+FFFD), and text that could be the start of a stop sequence. When a stop sequence appears, the text ends
right before it and the stream is done. Streaming and non-streaming responses are both built from these pieces,
so their text is the same.
"""

from typing import List, Optional, Sequence

_REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    """Accumulates one choice's tokens; :meth:`add` returns the text that became final."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), termination_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.termination_ids = {int(t) for t in termination_ids if t is not None and t >= 0}
        self.tokens: List[int] = []
        self.text = ""  # what has been released so far
        self.finish_reason: Optional[str] = None  # "stop" once a stop sequence or termination id was seen

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: Sequence[int]) -> str:
        """Take new tokens; return the newly released text ("" while held back or once done)."""
        if self.done:
            return ""
        for token in tokens:
            if int(token) in self.termination_ids:
                self.finish_reason = "stop"
                return self._release(self._decoded(), final=True)
            self.tokens.append(int(token))
        text = self._decoded()
        cut = self._first_stop(text)
        if cut is not None:
            self.finish_reason = "stop"
            return self._release(text[:cut], final=True)
        return self._release(text, final=False)

    def flush(self) -> str:
        """The held-back tail, once the engine says the request finished."""
        if self.done and self.finish_reason == "stop":
            return ""
        return self._release(self._decoded(), final=True)

    def _decoded(self) -> str:
        return self.tokenizer.detokenize(self.tokens) if self.tokens else ""

    def _first_stop(self, text: str) -> Optional[int]:
        # Only text after what was already released can hold a new stop sequence's end.
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        found = [index for index in (text.find(s, start) for s in self.stop) if index >= 0]
        return min(found) if found else None

    def _release(self, text: str, final: bool) -> str:
        if not final:
            text = text.rstrip(_REPLACEMENT_CHAR)
            text = text[: len(text) - self._stop_prefix_length(text)]
        if not text.startswith(self.text):
            # The decoder re-read earlier tokens differently (rare: merges across a character boundary): keep
            # what was sent, and send only what extends it once it does again.
            return ""
        piece = text[len(self.text) :]
        self.text = text
        return piece

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop sequence."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
