"""Each answer token's share of the reply's text: the token strings and `text_offset` of `logprobs`.

A token decoded alone is not its share of the text: a SentencePiece tokenizer drops the space of
"▁world" when that token starts a decode, and a character whose UTF-8 bytes span several byte-level (or
byte-fallback) tokens decodes to one U+FFFD per piece. So the text is cut where the decode of the tokens
so far stops agreeing with the decode of them all: token i gets `text[end(i):end(i + 1)]`, where end(k) is
the length of the common prefix of decode(tokens[:k]) and the text (made non-decreasing). The strings
concatenate to the text exactly, offsets count characters of it, and a character split over several
tokens goes whole to the token that completes it (the tokens before it get "", their `bytes` []).

While a reply streams, a trailing U+FFFD may be a character still incomplete, so the tokens that reach
into it wait until it is complete (or the reply ends)."""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence
ALT_CONTEXT = 4  # tokens of context for an alternative's string (alternatives need not concatenate)


@dataclass(frozen=True)
class TokenPiece:
    """One answer token with its share of the text and its alternatives' strings."""

    entry: object  # bdcore.decode.sequence.TokenLogprob
    text: str
    offset: int  # characters of the reply's text before this token's
    top: tuple[tuple[str, float], ...]


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection on C-speed `startswith` (a character loop in
    Python would cost a long reply seconds)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class TokenText:
    """The answer's tokens as they arrive, and the pieces of text already handed out."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.entries: list = []  # every entry added, handed out or not
        self.given = 0  # entries handed out
        self.at = 0  # characters of text handed out

    def add(self, entries) -> None:
        self.entries += entries

    def take(self, final: bool) -> list[TokenPiece]:
        """The pieces whose text is settled (all of them once `final`), in order, each handed out once."""
        ids = [e.token for e in self.entries]
        text = self._decode(ids)
        if not final:
            text = text.rstrip(REPLACEMENT)  # may still become a character
        prefixes = [self._decode(ids[: k + 1]) for k in range(self.given, len(ids))]
        if not final:  # a token whose decode reaches into the unsettled tail waits, and so do those after it
            settled = next((k for k, p in enumerate(prefixes) if len(p) > len(text)), len(prefixes))
            prefixes = prefixes[:settled]
        ends = [common_prefix_len(p, text) for p in prefixes]
        if final and ends:
            ends[-1] = len(text)  # whatever the last decode disagreed on is the last token's
        for k in range(len(ends) - 2, -1, -1):  # non-decreasing, so the pieces tile the text
            ends[k] = min(ends[k], ends[k + 1])
        pieces = []
        for k, end in enumerate(ends):
            end, i = max(end, self.at), self.given + k
            piece = text[self.at : end]
            pieces.append(TokenPiece(self.entries[i], piece, self.at, self._top(ids, i, piece)))
            self.at = end
        self.given += len(pieces)
        return pieces

    def _top(self, ids: list[int], i: int, chosen: str) -> tuple[tuple[str, float], ...]:
        """The alternatives' strings after the tokens before i (the chosen token keeps its own)."""
        e = self.entries[i]
        before = ids[max(0, i - ALT_CONTEXT) : i]
        base = self._decode(before)
        out = []
        for t, lp in e.top:
            if t == e.token:
                out.append((chosen, lp))
            else:
                with_t = self._decode([*before, t])
                out.append((with_t[common_prefix_len(base, with_t) :], lp))
        return tuple(out)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)  # as the reply's text: specials not shown
