"""Tokenizer: a small byte-level BPE trained offline, a user ``tokenizer.json``, or a tiktoken BPE
file (Kimi's ``tiktoken.model``, converted by ``k3train.data.tiktoken_file``).

``K3Tokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` and exposes what the
rest of k3train needs (``vocab_size``, ``eod``, ``encode``/``decode``), plus the
attributes that Megatron-Core's ``GPTDataset`` reads from its tokenizer
(``vocab_size``, ``eod``, ``unique_identifiers``). This module does not import
Megatron-Core, so it is cheap to import.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

EOD_TOKEN = "<|endoftext|>"
# Looked up, in order, in a user tokenizer that does not name its EOD explicitly.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<eod>", "[EOS]")
# 256 byte symbols + the EOD token.
MIN_BYTE_BPE_VOCAB = 257


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = EOD_TOKEN,
                         length: Optional[int] = None):
    """Train a byte-level BPE on ``texts`` and return a ``tokenizers.Tokenizer``.

    The vocabulary holds the EOD token (id 0), the 256 byte symbols and
    ``vocab_size - 257`` merges, never more than ``vocab_size`` ids. Any string
    round-trips exactly through encode/decode. Training is deterministic for the
    same texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BYTE_BPE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{MIN_BYTE_BPE_VOCAB} (256 bytes + EOD)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


class K3Tokenizer:
    """A ``tokenizers.Tokenizer`` with an EOD id, as k3train and Megatron-Core use it."""

    def __init__(self, tokenizer, eod_token: Optional[str] = None, path: Optional[str] = None):
        self._tok = tokenizer
        self.path = path
        # Raw text may contain the literal EOD string; it must never become a document
        # boundary, so special tokens in text are encoded as ordinary bytes.
        try:
            self._tok.encode_special_tokens = True
        except AttributeError:  # tokenizers < 0.15
            pass
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if eod_token is None:
            eod_token = next((t for t in EOD_CANDIDATES if t in vocab), None)
            if eod_token is None:
                raise ValueError(
                    f"tokenizer {path or '<in memory>'} has no end-of-document token "
                    f"(looked for {', '.join(EOD_CANDIDATES)}); add one or pass eod_token"
                )
        elif eod_token not in vocab:
            raise ValueError(f"tokenizer {path or '<in memory>'} has no token {eod_token!r}")
        self.eod_token = eod_token
        self.eod = int(vocab[eod_token])
        # Some tokenizer.json files leave holes in the id space; the model must cover
        # the largest id, so that is what counts.
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()[:16]
        # Read by Megatron-Core when it hashes a dataset description.
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size), ("eod", self.eod),
             ("fingerprint", self.fingerprint)]
        )

    # Megatron-Core's GPTDataset checks pad/eos against eod; we have no pad token.
    @property
    def eos(self) -> int:
        return self.eod

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str) -> None:
        """Write the tokenizer.json atomically."""
        tmp = f"{path}.tmp-{os.getpid()}"
        self._tok.save(tmp)
        os.replace(tmp, path)

    def __repr__(self) -> str:
        return f"K3Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


# The tokenizer files of an HF model folder, in the order they are looked for; tokenizer_config.json
# names a tiktoken file's special tokens.
HF_TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")
HF_TOKENIZER_SIDECARS = ("tokenizer_config.json",)


def tokenizer_in(folder: str) -> Optional[str]:
    """The tokenizer file of an HF-style ``folder`` (``HF_TOKENIZER_FILES``), or None."""
    for name in HF_TOKENIZER_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def load_tokenizer(path: str, eod_token: Optional[str] = None) -> K3Tokenizer:
    """Load a ``tokenizer.json`` (ours or any Hugging Face one), a tiktoken BPE file, or the
    tokenizer of an HF folder (``tokenizer_in``)."""
    from tokenizers import Tokenizer

    from k3train.data.tiktoken_file import is_tiktoken_file, tiktoken_tokenizer

    path = os.path.expanduser(str(path))
    if os.path.isdir(path) and tokenizer_in(path):
        path = tokenizer_in(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tokenizer file not found: {path} (data.tokenizer takes a tokenizer.json, a tiktoken .model file "
            f"or an HF folder holding one; python -m data_prep.tokenize_corpus writes <output-prefix>.tokenizer.json)"
        )
    if is_tiktoken_file(path):
        return K3Tokenizer(tiktoken_tokenizer(path), eod_token=eod_token, path=path)
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"cannot read tokenizer {path}: {msg}") from None
    return K3Tokenizer(tok, eod_token=eod_token, path=path)


def check_vocab(model_vocab: int, tokenizer: K3Tokenizer) -> None:
    """Raise ValueError if the model's embedding cannot hold every token id."""
    if int(model_vocab) < tokenizer.vocab_size:
        where = tokenizer.path or "the tokenizer"
        raise ValueError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} ids, {where}); set model.vocab_size={tokenizer.vocab_size} "
            f"or more, or use a tokenizer with at most {model_vocab} ids"
        )


def default_tokenizer_path(prefix: str) -> str:
    """Where ``data_prep.tokenize_corpus`` writes the tokenizer of dataset ``prefix``."""
    return f"{prefix}.tokenizer.json"
