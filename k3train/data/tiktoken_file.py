"""A tiktoken BPE file (Kimi's ``tiktoken.model``) as a ``tokenizers.Tokenizer``.

The file has one line per token, ``base64(token bytes) rank``, ranks 0..N-1. tiktoken encodes a
pre-token by keeping it whole when it is a token, else by merging, again and again, the adjacent
pair whose concatenation has the lowest rank. The same tokenizer in ``tokenizers`` terms:

    vocab    byte-level strings (GPT-2's byte→char map) → rank
    merges   for every token t of ≥ 2 bytes and every cut t = a + b with a, b both tokens,
             (a, b), ordered by rank(t), then rank(a), rank(b): lowest rank merges first
    model    BPE with ``ignore_merges`` (a whole pre-token that is a token is kept, as tiktoken does)
    pre-tok  Split(pattern, isolated) then ByteLevel without its own regex
    specials ids N..N+R-1 (R = 256 reserved, as Kimi's tokenizer): the names in a
             ``tokenizer_config.json`` beside the file (``added_tokens_decoder``), else
             ``<|reserved_token_{id}|>``

The pattern is not in the file; the default is Kimi's (its ``tokenization_kimi.py``): Han runs
alone, letters with an optional leading non-letter and English contractions, numbers in groups of
up to 3, punctuation runs, newlines, spaces. Nothing is downloaded.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Optional

KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_NAMES = ("tiktoken.model",)  # what an HF folder calls it


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map, which ``ByteLevel`` uses: printable
    Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def is_tiktoken_file(path: str) -> bool:
    """Whether the first line of ``path`` reads ``<base64> <integer>``."""
    with open(path, "rb") as f:
        first = f.readline(4096).split()
    if len(first) != 2 or not first[1].isdigit():
        return False
    try:
        base64.b64decode(first[0], validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def read_ranks(path: str) -> dict[bytes, int]:
    """token bytes → rank; ranks must be 0..N-1 and every single byte a token."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{n}: not a tiktoken BPE line (<base64> <rank>): "
                                 f"{line[:60]!r}; give a tiktoken .model file or a tokenizer.json") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1} without repeats; the file is damaged")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: byte {missing[0]:#04x} (and {len(missing) - 1} more) is not a token; "
                         f"a byte-level tiktoken file has all 256")
    return ranks


def special_token_names(path: str, first_id: int) -> dict[int, str]:
    """id → name for the reserved block after the BPE ids, from a ``tokenizer_config.json``
    beside ``path`` where one exists."""
    names = {i: f"<|reserved_token_{i}|>" for i in range(first_id, first_id + NUM_RESERVED_SPECIAL_TOKENS)}
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            decoder = json.load(f).get("added_tokens_decoder") or {}
        for key, entry in decoder.items():
            i = int(key)
            if i < first_id:
                raise ValueError(f"{cfg_path}: added token id {i} ({entry.get('content')!r}) lies inside the "
                                 f"BPE ids of {path} (0..{first_id - 1}); the two files do not belong together")
            names[i] = entry["content"]
    if sorted(names) != list(range(first_id, first_id + len(names))):
        raise ValueError(f"{cfg_path}: the added token ids leave holes after {first_id}")
    return names


def tiktoken_tokenizer(path: str, pattern: Optional[str] = None):
    """The ``tokenizers.Tokenizer`` equivalent of tiktoken file ``path`` (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = read_ranks(path)
    to_char = byte_to_char()

    def text(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    vocab = {text(t): r for t, r in ranks.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern or KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = special_token_names(path, len(ranks))
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    return tok
