"""How many characters of prompt text one token can stand for at most, so that a prompt too long for the
context is refused by its length alone, before it is tokenised (a 4 MB prompt costs a tokenizer seconds
and gigabytes, and was refused afterwards anyway).

The bound must be sound: a prompt that fits must never be refused by it. It is read off the fast
tokenizer's pipeline (`tokenizer.json`) and holds when every character of the text ends up in some token
and no token stands for more than `m` characters, `m` the longest token string of the vocabulary or the
longest added token. Then a text of n characters needs at least n / (f * m) tokens, with f the most
characters the normalizer folds into one (4 for NFC/NFKC: the longest canonical decomposition). Pipelines
where that fails give None (no early refusal): a normalizer or pre-tokenizer that drops text (Strip,
StripAccents, Whitespace, Split "removed", ...), an unknown-token that swallows a run of any length
(`fuse_unk`, a word-level model whose words are unbounded, an added token with lstrip/rstrip), a BPE that
silently drops characters it has no token for, or any component not known here."""

from __future__ import annotations

import json

from inference.server.protocol import APIError

COMPOSING = 4  # NFC/NFKC fold at most 4 characters into one (tests/test_large_prompts.py checks it)
_SAME_OR_LONGER = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLIT_BEHAVIOURS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}  # all but "Removed"
_ONE_CHARACTER = {r"[\s\S]", r"(?s)."}  # split patterns that isolate every single character


def chars_per_token(tokenizer) -> int | None:
    """The most prompt characters one token stands for, or None where this tokenizer cannot promise one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    fold = _normalizer_fold(spec.get("normalizer"))
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    added = spec.get("added_tokens") or []
    if fold is None or pre is None or any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab or not _model_keeps_every_character(model, pre):
        return None
    longest = max(max(map(len, vocab)), max((len(t["content"]) for t in added), default=1))
    return fold * longest


def _normalizer_fold(spec) -> int | None:
    """The most input characters the normalizer turns into one, or None if it may drop text."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        fold = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_fold(part)
            if f is None:
                return None
            fold *= f
        return fold
    if kind in ("NFC", "NFKC"):
        return COMPOSING
    if kind in _SAME_OR_LONGER:
        return 1
    if kind == "Replace":  # a literal pattern replaced by a non-empty string (SentencePiece: " " -> "▁")
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content") or ""
        if not pattern or not content:
            return None
        return max(1, -(-len(pattern) // len(content)))
    return None


def _pre_tokenizers(spec) -> list[dict] | None:
    """The pre-tokenizers in order, or None if one may drop text."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        out = []
        for part in spec.get("pretokenizers", []):
            parts = _pre_tokenizers(part)
            if parts is None:
                return None
            out += parts
        return out
    kind = spec.get("type")
    if kind in _KEEPING_PRE_TOKENIZERS:
        return [spec]
    if kind in ("Split", "Punctuation") and spec.get("behavior", "Isolated") in _SPLIT_BEHAVIOURS:
        return [spec]
    return None


def _model_keeps_every_character(model: dict, pre: list[dict]) -> bool:
    """Whether every character of a pre-token lands in tokens of at most the vocabulary's longest string."""
    vocab, kind = model["vocab"], model.get("type")
    unk = model.get("unk_token")
    if kind == "BPE":
        if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return True  # a character with no token goes out as its bytes
        if any(p.get("type") == "ByteLevel" for p in pre):
            from tokenizers.pre_tokenizers import ByteLevel

            return all(c in vocab for c in ByteLevel.alphabet())  # every byte has a token
        return unk in vocab and not model.get("fuse_unk")  # one unknown token per unknown character
    if kind == "WordLevel":  # one token per pre-token: bounded only where pre-tokens are single characters
        return unk in vocab and any(
            p.get("type") == "Split"
            and p.get("behavior") == "Isolated"
            and not p.get("invert")
            and (p.get("pattern") or {}).get("Regex") in _ONE_CHARACTER
            for p in pre
        )
    return False


def check_prompt_chars(n_chars: int, chars_per_token: int | None, max_context: int, param: str) -> None:
    """Refuse, before tokenising, a prompt of `n_chars` characters that cannot fit in fewer tokens than the
    context holds (the same refusal the token count would give, in OpenAI's wording)."""
    if chars_per_token is None:
        return
    at_least = -(-n_chars // chars_per_token)
    if at_least >= max_context:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, your prompt has {n_chars} "
            f"characters, at least {at_least} tokens for this model's tokenizer (a token stands for at most "
            f"{chars_per_token} characters). Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
