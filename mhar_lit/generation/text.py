"""Incremental detokenization and stop strings: the text of a growing continuation without decoding it all
again at every token.

`IncrementalText.push(token)` decodes a short window of recent tokens twice (with and without the new ones)
and appends the difference, so a step costs a few tokens' decoding whatever the length of the text. The window
starts at the last point where the text was complete: tokenizers that decode a token differently at the start
of a sequence (a leading-space marker) or that need several tokens for one character (byte-level BPE, byte
tokenizers: U+FFFD until the last byte arrives) give the same text as decoding everything, because text is
only emitted once it no longer ends in an incomplete character.

`StopMatcher` finds a stop string in that text by searching only the part that can contain a new occurrence:
the text added since the last check plus the longest stop string's length minus one before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what decoders put where a multi-byte character is still missing bytes


class IncrementalText:
    """`text` of the tokens pushed so far, equal to `decode(tokens)` for prefix-stable decoders, except that an
    incomplete character at the end is held back until `finish()`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first token: decoding starts there
        self._read = 0  # tokens up to here are already in `text`

    def push(self, token: int) -> str:
        """Add one token; returns the text it completed ("" while a character is incomplete)."""
        self.tokens.append(token)
        return self._emit(final=False)

    def finish(self) -> str:
        """Emit what was held back (an incomplete character at the very end); returns it."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self.tokens):
            return ""
        before = self.decode(self.tokens[self._prefix:self._read])
        after = self.decode(self.tokens[self._prefix:])
        if not after.startswith(before):  # a decoder that rewrites earlier text here: decode everything once
            before, after = self.text, self.decode(self.tokens)
        if (after.endswith(INCOMPLETE) and not final) or not after.startswith(before):
            return ""
        new = after[len(before):]
        self._prefix, self._read = self._read, len(self.tokens)
        self.text += new
        return new


class StopMatcher:
    """Whether a growing text contains any of the stop strings, checking only what can hold a new occurrence."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._overlap = max((len(s) for s in self.stop), default=1) - 1
        self._checked = 0  # text[:_checked] held no stop string

    def found(self, text: str) -> bool:
        start = max(0, self._checked - self._overlap)
        window = text[start:]
        self._checked = len(text)
        return any(s in window for s in self.stop)
