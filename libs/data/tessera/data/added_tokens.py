"""Added (special) tokens inside text, found as Hugging Face `tokenizers` finds them, which is
transformers' default: such a token becomes its id, it is not encoded as plain text.

HF's rule (its AddedVocabulary): tokens whose `normalized` flag is off are cut out of the raw text
first; each remaining piece is then normalized and the `normalized` tokens (in their normalized
form) are cut out of it. Matches are leftmost-longest and do not overlap; `single_word` drops a
match that touches a word character, `lstrip` / `rstrip` add the whitespace beside a match to it.
The text between matches is encoded on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import regex


@dataclass(frozen=True)
class TokenMatch:
    """How one added token is found in text: tokenizer.json's added_tokens flags. The defaults
    are transformers' for a special token."""

    normalized: bool = False
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False


DEFAULT_MATCH = TokenMatch()

# HF's checks use Rust's Unicode \w and \s; Python's differ on a few characters (\x1c-\x1f, ½).
_WORD = regex.compile(r"[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]")
_SPACE = regex.compile(r"\p{White_Space}")


class AddedTokens:
    """Splits text at the added tokens `tokens` (content -> id), each matched as `matching` says
    (absent: `DEFAULT_MATCH`); `normalize` is the tokenizer's normalizer (None: none)."""

    def __init__(self, tokens: dict[str, int], matching: dict[str, TokenMatch],
                 normalize: Callable[[str], str] | None = None):
        how = {content: matching.get(content, DEFAULT_MATCH) for content in tokens if content}
        self._normalize = normalize
        self._raw = _Matcher({t: (tokens[t], m) for t, m in how.items() if not m.normalized})
        self._normalized = _Matcher({normalize(t) if normalize else t: (tokens[t], m)
                                     for t, m in how.items() if m.normalized})

    def split(self, text: str) -> Iterator[str | int]:
        """`text` in order as normalized pieces (non-empty str) and added-token ids (int)."""
        for part in self._raw.split(text):
            if isinstance(part, int):
                yield part
            else:
                yield from self._normalized.split(self._normalize(part) if self._normalize else part)


class _Matcher:
    """One of HF's two passes: leftmost-longest matches of the given contents, flags applied."""

    def __init__(self, found: dict[str, tuple[int, TokenMatch]]):
        self._found = found
        # An alternation tries its branches in order, so the longest first makes it leftmost-longest.
        longest_first = sorted(found, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if found else None

    def split(self, text: str) -> Iterator[str | int]:
        start = 0
        for match in self._pattern.finditer(text) if self._pattern else ():
            token_id, how = self._found[match.group()]
            begin, end = match.span()
            if how.single_word and ((begin > 0 and _WORD.match(text, begin - 1))
                                    or (end < len(text) and _WORD.match(text, end))):
                continue
            while how.lstrip and begin > start and _SPACE.match(text, begin - 1):
                begin -= 1
            while how.rstrip and end < len(text) and _SPACE.match(text, end):
                end += 1
            if begin > start:
                yield text[start:begin]
            yield token_id
            start = end
        if start < len(text):
            yield text[start:]
