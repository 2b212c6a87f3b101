"""Incremental detokenization: the text a request's new tokens add, as they are sampled, and stop strings.

Byte-level BPE splits one character over several tokens (an emoji, most CJK text): decoding each token alone
gives U+FFFD halves. So the text of a window of recent tokens is decoded twice, with and without the newest
ones, and the difference is what they add; while the window's text still ends in an incomplete character the
new text is held back until a later token completes it (or the request ends). The concatenated deltas equal
``tokenizer.decode(all output tokens, skip_special_tokens=True)``, which is what ``LLM.generate`` returns.

With stop strings the text is searched as it grows: the output ends before the first match (the stop string
is not part of it, as in the OpenAI API), and the last ``len(longest stop) - 1`` characters are held back so a
stop string split over tokens is never half sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded before the newest ones, so that a merge across the boundary (a leading space, a multi-token
# character) decodes as it does in the whole text.
_CONTEXT_TOKENS = 5


@dataclass
class TextDelta:
    """What one call to ``IncrementalDetokenizer.add`` produced: the text to send now, and whether a stop
    string ended the output (``num_tokens`` then counts the tokens up to the one that completed it)."""

    text: str
    stopped: bool = False
    num_tokens: int = 0


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas. Called from the engine thread after every step
    with the request's new tokens; ``finish`` once when it ends, for the text still held back."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0    # tokens whose text is already in self.text
        self.text = ""           # the output text decoded so far (stop-truncated once stopped)
        self._sent = 0           # characters of self.text already handed out
        self.stopped = False

    def add(self, new_token_ids: Sequence[int]) -> TextDelta:
        """The text ``new_token_ids`` add (possibly empty: an incomplete character, or held back for a stop)."""
        if self.stopped:
            return TextDelta("", stopped=True, num_tokens=len(self.token_ids))
        for token_id in new_token_ids:
            self.token_ids.append(int(token_id))
            self._decode_newest()
            if self.stop and self._cut_at_stop():
                return TextDelta(self._take(final=True), stopped=True, num_tokens=len(self.token_ids))
        return TextDelta(self._take(final=False), num_tokens=len(self.token_ids))

    def finish(self) -> str:
        """The text still held back when the request ends (an incomplete character is sent as decoded)."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            self.text += self._decode(self._prefix_offset, len(self.token_ids))[
                len(self._decode(self._prefix_offset, self._read_offset)):]
            self._read_offset = len(self.token_ids)
        return self._take(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def _decode_newest(self) -> None:
        before = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self.token_ids))
        if window.endswith(REPLACEMENT_CHAR) or len(window) <= len(before):
            return  # an incomplete character (or nothing visible yet): wait for the next token
        self.text += window[len(before):]
        self._prefix_offset = max(0, len(self.token_ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self.token_ids)

    def _cut_at_stop(self) -> bool:
        # Only the new part can hold a new match: search from where a match could first have started.
        start = max(0, self._sent - self._hold - 1)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not found:
            return False
        self.text = self.text[:min(found)]
        self.stopped = True
        return True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or not self.stop else max(self._sent, len(self.text) - self._hold)
        delta, self._sent = self.text[self._sent:end], end
        return delta
