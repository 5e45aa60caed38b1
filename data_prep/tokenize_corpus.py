"""Tokenize a corpus into a Megatron-Core indexed dataset (.bin/.idx).

    python -m data_prep.tokenize_corpus --input corpus.jsonl --output-prefix data/corpus
    python -m data_prep.tokenize_corpus --input src/ --glob '**/*.py' --output-prefix data/code \\
        --vocab-size 4096
    python -m data_prep.tokenize_corpus --input a.jsonl b.jsonl --tokenizer tokenizer.json \\
        --output-prefix data/ab

Inputs:
  * JSONL (``.jsonl``, ``.ndjson``, ``.jsonl.gz``): one document per line, text in
    the ``--text-key`` field (default ``text``).
  * a directory: every file matching ``--glob`` (default ``**/*``; hidden files and
    folders skipped) is one document; JSONL files in it are read as JSONL.
  * any other file: one document.

Outputs, all next to each other:
  * ``PREFIX.bin`` / ``PREFIX.idx``: the indexed dataset, one sequence per document,
    each ending with the EOD token;
  * ``PREFIX.tokenizer.json``: the tokenizer (trained, or ``--tokenizer`` as a tokenizer.json);
  * ``PREFIX.meta.json``: counts, vocab size, EOD id, the largest token id.

Files are written under temporary names and renamed at the end, so a failed or
interrupted run leaves any earlier output as it was. An existing output is only
replaced with ``--overwrite``.

Policy for text that is not valid UTF-8 (``--on-invalid-utf8``):
  * ``error`` (default): stop with the file, line and byte offset of the first bad byte;
  * ``skip``: drop that document and report the count in the summary.
Empty (whitespace-only) documents and binary files (a NUL byte) are skipped and counted.

Scale:
  * ``--workers N`` encodes batches of documents in N worker processes (each loads the
    tokenizer once) and writes them in input order: the output is byte-identical to
    ``--workers 1``, which encodes in this process.
  * A document longer than ``PIECE_CHARS`` characters is encoded in pieces cut only
    where the byte-level pre-tokenizer splits anyway (see ``split_document``), so the
    ids equal those of encoding it whole, and its ids are written as each piece is done.
    Memory stays bounded by the piece and batch sizes, not by the largest document.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gzip
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from k3train.data.tokenizer import (
    EOD_TOKEN,
    K3Tokenizer,
    default_tokenizer_path,
    load_tokenizer,
    train_byte_level_bpe,
)

PROG = "tokenize_corpus"
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
ENCODE_BATCH_DOCS = 64
# Characters encoded in one call. Encoding costs ~230 bytes of transient memory per input
# byte (the ``tokenizers`` Encoding and pre-tokenizer alignments), so these two bound the
# peak: a batch holds at most ENCODE_BATCH_CHARS characters (or one piece), and a longer
# document is cut into pieces of PIECE_CHARS characters and a little more, up to the next
# place where it can be cut (``split_document``; a stretch with none stays whole).
PIECE_CHARS = 256 * 1024
ENCODE_BATCH_CHARS = 1 << 20


class CorpusError(ValueError):
    """A problem with the input corpus or the output location (one line)."""


@dataclass
class Stats:
    files: int = 0
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped_empty: int = 0
    skipped_binary: int = 0
    skipped_invalid_utf8: int = 0
    max_token_id: int = -1

    def skipped(self) -> str:
        return (f"skipped {self.skipped_empty} empty, {self.skipped_binary} binary, "
                f"{self.skipped_invalid_utf8} invalid UTF-8")


@dataclass
class Summary:
    prefix: str
    tokenizer_path: str
    vocab_size: int
    eod: int
    seconds: float
    stats: Stats = field(default_factory=Stats)

    def line(self) -> str:
        s = self.stats
        return (f"{PROG}: {s.documents} documents, {s.tokens} tokens (incl. EOD) -> "
                f"{self.prefix}.bin/.idx | tokenizer {self.tokenizer_path} (vocab {self.vocab_size}, "
                f"eod {self.eod}) | {s.skipped()} | {self.seconds:.1f}s")


# ----------------------------------------------------------------------------- inputs


def _is_jsonl(path: Path, fmt: str) -> bool:
    if fmt != "auto":
        return fmt == "jsonl"
    return path.name.lower().endswith(JSONL_SUFFIXES)


def list_sources(inputs: Sequence[str], globs: Sequence[str] = ("**/*",)) -> list[Path]:
    """Expand inputs (files and directories) into a sorted, de-duplicated file list."""
    if not inputs:
        raise CorpusError("no --input given")
    out: list[Path] = []
    for inp in inputs:
        p = Path(os.path.expanduser(str(inp)))
        if p.is_dir():
            found = set()
            for pattern in globs:
                for f in p.glob(pattern):
                    rel = f.relative_to(p).parts
                    if f.is_file() and not any(part.startswith(".") for part in rel):
                        found.add(f)
            if not found:
                raise CorpusError(f"no files match --glob {' '.join(globs)} in directory {p}")
            out.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            out.append(p)
        else:
            raise CorpusError(f"input not found: {p}")
    seen, uniq = set(), []
    for f in out:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            uniq.append(f)
    return uniq


def _bad_utf8(policy: str, stats: Stats, where: str) -> None:
    if policy == "skip":
        stats.skipped_invalid_utf8 += 1
        return
    raise CorpusError(f"invalid UTF-8 in {where} (use --on-invalid-utf8 skip to drop such documents)")


def iter_documents(
    sources: Sequence[Path],
    *,
    text_key: str = "text",
    fmt: str = "auto",
    on_invalid_utf8: str = "error",
    max_bytes: Optional[int] = None,
    stats: Optional[Stats] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Iterator[str]:
    """Yield document texts in a fixed order. ``max_bytes`` stops after the document
    that reaches that many raw input bytes (document-granular, deterministic)."""
    if on_invalid_utf8 not in ("error", "skip"):
        raise CorpusError(f"--on-invalid-utf8 must be 'error' or 'skip', got {on_invalid_utf8!r}")
    stats = stats if stats is not None else Stats()
    tick = progress or (lambda n: None)

    def take(nbytes: int) -> None:
        stats.documents += 1
        stats.bytes += nbytes

    for path in sources:
        if max_bytes is not None and stats.bytes >= max_bytes:
            return
        stats.files += 1
        if _is_jsonl(path, fmt):
            opener = gzip.open if path.name.endswith(".gz") else open
            offset = 0
            with opener(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    start, offset = offset, offset + len(raw)
                    tick(len(raw))
                    if not raw.strip():
                        continue
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        _bad_utf8(on_invalid_utf8, stats, f"{path} line {lineno} at byte {start + e.start}")
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise CorpusError(f"{path} line {lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
                    if not isinstance(obj, dict) or text_key not in obj:
                        raise CorpusError(f"{path} line {lineno}: no {text_key!r} field (set --text-key)")
                    text = obj[text_key]
                    if not isinstance(text, str):
                        raise CorpusError(f"{path} line {lineno}: field {text_key!r} is {type(text).__name__}, not a string")
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:  # a lone surrogate escape such as "\udc80"
                        _bad_utf8(on_invalid_utf8, stats, f"{path} line {lineno} (unpaired surrogate at character {e.start} of {text_key!r})")
                        continue
                    if text.strip():
                        take(len(raw))
                        yield text
                        if max_bytes is not None and stats.bytes >= max_bytes:
                            return
                    else:
                        stats.skipped_empty += 1
        else:
            data = path.read_bytes()
            tick(len(data))
            if b"\x00" in data:
                stats.skipped_binary += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                _bad_utf8(on_invalid_utf8, stats, f"{path} at byte {e.start}")
                continue
            if text.startswith("\ufeff"):
                text = text[1:]
            if text.strip():
                take(len(data))
                yield text
            else:
                stats.skipped_empty += 1


# ----------------------------------------------------------------------------- encoding

# Where ``split_document`` may cut: before a space or newline whose preceding character is
# surely not whitespace. Python's ``\s`` and the tokenizer's regex engine disagree on a few
# characters (U+001C-U+001F, U+0085, U+200B, ...), so every character either might count as
# whitespace is excluded from "surely not whitespace".
_CUT = re.compile(r"(?<=[^\s\x00-\x20\x7f-\xa0\u1680\u180e\u2000-\u200f\u2028-\u202f"
                  r"\u205f-\u2064\u3000\ufeff])[ \n]")


def can_split_documents(tokenizer_json: str, encode_special_tokens: bool = True) -> bool:
    """Whether ``split_document``'s cuts leave this tokenizer's ids unchanged.

    True for a byte-level BPE whose only pre-tokenizer is ``ByteLevel(use_regex=True,
    add_prefix_space=False)`` (ours, GPT-2's) with no normalizer. Its regex is
    ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``: a
    match that holds a non-whitespace character never goes on into whitespace (the only
    optional space is a leading one), and the one look-ahead, ``(?!\\S)``, belongs to a
    whitespace run. So before a space or newline that follows a non-whitespace character
    every match ends, whether or not the text goes on, and the matches after it start
    there as in a fresh string: the pre-tokens, hence the ids, of the two sides are those
    of the whole. (Cutting *after* a newline is not safe: ``"a  \\n"`` alone is one
    whitespace pre-token, but ``"  "`` and ``"\\n"`` when a letter follows.) Added tokens
    that could span a cut (holding a space or newline, or stripping whitespace) also rule
    it out; special tokens do not, since K3Tokenizer encodes them as plain text.
    """
    cfg = json.loads(tokenizer_json)
    pre = cfg.get("pre_tokenizer") or {}
    if cfg.get("normalizer") is not None or pre.get("type") != "ByteLevel":
        return False
    if not pre.get("use_regex", True) or pre.get("add_prefix_space", True):
        return False
    for t in cfg.get("added_tokens") or []:
        if t.get("special") and encode_special_tokens:
            continue
        content = t.get("content", "")
        if " " in content or "\n" in content or t.get("lstrip") or t.get("rstrip"):
            return False
    return True


def split_document(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``piece_chars`` characters, each cut right before
    a space or newline that follows a non-whitespace character (``can_split_documents``
    says why the ids do not change). A stretch with no such place stays whole."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        m = _CUT.search(text, start + piece_chars)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def document_units(text: str, piece_chars: Optional[int]) -> list[tuple[str, bool]]:
    """``(text, ends_document)`` for each piece of one document (``piece_chars`` None: whole)."""
    if piece_chars is None or len(text) <= piece_chars:
        return [(text, True)]
    pieces = split_document(text, piece_chars)
    return [(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


class UnitEncoder:
    """Encodes units (documents or pieces of one) into ids of the output dtype.

    Holds its own copy of the tokenizer with truncation and padding off: a user
    tokenizer.json may carry them, and a dataset must hold every token of a document.
    """

    def __init__(self, tokenizer_json: str, eod_token: str, dtype: str):
        import numpy
        from tokenizers import Tokenizer

        self.tok = K3Tokenizer(Tokenizer.from_str(tokenizer_json), eod_token=eod_token)
        self.tok.backend.no_truncation()
        self.tok.backend.no_padding()
        self.dtype = numpy.dtype(dtype)
        self._np = numpy

    def encode(self, units: Sequence[tuple[str, bool]]):
        """The ids of all units back to back, EOD after each document's last unit, and
        the number of ids of each unit."""
        np, eod = self._np, self.tok.eod
        arrays = [np.array(ids + [eod] if last else ids, dtype=self.dtype)
                  for ids, (_, last) in zip(self.tok.encode_batch([u for u, _ in units]), units)]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=self.dtype)
        return flat, [a.size for a in arrays]


def iter_batches(docs: Iterable[str], piece_chars: Optional[int], max_units: int = ENCODE_BATCH_DOCS,
                 max_chars: int = ENCODE_BATCH_CHARS) -> Iterator[list[tuple[str, bool]]]:
    """Group the units of ``docs`` into batches of at most ``max_units`` units and
    ``max_chars`` characters (a longer unit alone), in order."""
    batch: list[tuple[str, bool]] = []
    chars = 0
    for text in docs:
        for unit in document_units(text, piece_chars):
            n = len(unit[0])
            if batch and (len(batch) == max_units or chars + n > max_chars):
                yield batch
                batch, chars = [], 0
            batch.append(unit)
            chars += n
    if batch:
        yield batch


_WORKER_ENCODER: Optional[UnitEncoder] = None


def _worker_init(tokenizer_json: str, eod_token: str, dtype: str) -> None:
    # N workers already use N cores; the tokenizer's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _WORKER_ENCODER
    _WORKER_ENCODER = UnitEncoder(tokenizer_json, eod_token, dtype)


def _worker_encode(units):
    return _WORKER_ENCODER.encode(units)


def write_tokens(docs: Iterable[str], out, tok: K3Tokenizer, dtype, *, workers: int = 1,
                 piece_chars: Optional[int] = PIECE_CHARS, stats: Optional[Stats] = None,
                 start_method: str = "spawn") -> list[int]:
    """Encode ``docs`` and write their ids (``dtype``) to the binary file ``out`` as they
    come, each document followed by EOD. Returns the number of ids of each document.

    Documents over ``piece_chars`` characters are encoded in pieces (``split_document``)
    when ``can_split_documents`` allows it for ``tok``, else whole. ``workers`` > 1
    encodes batches in that many processes (``start_method``), at most two batches per
    worker in flight, and writes them in input order: the bytes are those of
    ``workers=1``, which encodes here, on the tokenizer's own thread pool.
    """
    import numpy

    if workers < 1:
        raise CorpusError(f"--workers must be at least 1, got {workers}")
    stats = stats if stats is not None else Stats()
    tokenizer_json = tok.backend.to_str()
    if piece_chars is not None and not can_split_documents(
            tokenizer_json, getattr(tok.backend, "encode_special_tokens", False)):
        piece_chars = None
    dtype = numpy.dtype(dtype).name
    lengths: list[int] = []
    doc_len = 0

    def write(result, batch) -> None:
        nonlocal doc_len
        flat, sizes = result
        if flat.size:
            out.write(flat.tobytes(order="C"))
            stats.tokens += int(flat.size)
            stats.max_token_id = max(stats.max_token_id, int(flat.max()))
        for n, (_, last) in zip(sizes, batch):
            doc_len += n
            if last:
                lengths.append(doc_len)
                doc_len = 0

    if workers == 1:
        encoder = UnitEncoder(tokenizer_json, tok.eod_token, dtype)
        for batch in iter_batches(docs, piece_chars):
            write(encoder.encode(batch), batch)
        return lengths

    # A process pool that fails loudly (BrokenProcessPool) when a worker dies or cannot
    # start, where multiprocessing.Pool would start new ones forever.
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(start_method), initializer=_worker_init,
        initargs=(tokenizer_json, tok.eod_token, dtype))
    try:
        pending: collections.deque = collections.deque()
        for batch in iter_batches(docs, piece_chars):
            pending.append((pool.submit(_worker_encode, batch), batch))
            if len(pending) >= 2 * workers:
                future, done = pending.popleft()
                write(future.result(), done)
        while pending:
            future, done = pending.popleft()
            write(future.result(), done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return lengths


# ----------------------------------------------------------------------------- output


def output_paths(prefix: str) -> dict[str, str]:
    return {
        "bin": f"{prefix}.bin",
        "idx": f"{prefix}.idx",
        "tokenizer": default_tokenizer_path(prefix),
        "meta": f"{prefix}.meta.json",
    }


def _progress_bar(total: Optional[int], desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled,
                file=sys.stderr, dynamic_ncols=True, leave=False)


def tokenize_corpus(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    tokenizer: Optional[str] = None,
    vocab_size: int = 512,
    eod_token: Optional[str] = None,
    text_key: str = "text",
    globs: Sequence[str] = ("**/*",),
    fmt: str = "auto",
    on_invalid_utf8: str = "error",
    max_bytes: Optional[int] = None,
    train_max_bytes: Optional[int] = 200 * 2**20,
    overwrite: bool = False,
    progress: bool = True,
    workers: int = 1,
    piece_chars: Optional[int] = PIECE_CHARS,
) -> Summary:
    """Tokenize ``inputs`` into ``output_prefix``.{bin,idx,tokenizer.json,meta.json}.

    With ``tokenizer`` None, trains a byte-level BPE of ``vocab_size`` on the first
    ``train_max_bytes`` of the corpus. Raises ``CorpusError`` (a ValueError) with a
    one-line message on bad input; earlier output is never touched on failure.
    ``workers`` and ``piece_chars``: see ``write_tokens``.
    """
    t0 = time.time()
    if workers < 1:
        raise CorpusError(f"--workers must be at least 1, got {workers}")
    output_prefix = os.path.expanduser(str(output_prefix))
    if not output_prefix or output_prefix.endswith(os.sep) or os.path.isdir(output_prefix):
        raise CorpusError(f"--output-prefix must name a file prefix, not a directory: {output_prefix!r}")
    paths = output_paths(output_prefix)
    existing = [p for p in (paths["bin"], paths["idx"]) if os.path.exists(p)]
    if existing and not overwrite:
        raise CorpusError(f"output exists: {existing[0]} (pass --overwrite to replace it)")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    sources = list_sources(inputs, globs)
    total_bytes = sum(_file_size(p) for p in sources)
    if max_bytes is not None:
        total_bytes = min(total_bytes, max_bytes)

    # 1. Tokenizer: load, or train on a first pass over the corpus.
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer, eod_token=eod_token)
    else:
        budget = max_bytes if train_max_bytes is None else (
            train_max_bytes if max_bytes is None else min(max_bytes, train_max_bytes))
        train_stats = Stats()
        with _progress_bar(min(total_bytes, budget or total_bytes), "train BPE", progress) as bar:
            docs = iter_documents(sources, text_key=text_key, fmt=fmt, on_invalid_utf8=on_invalid_utf8,
                                  max_bytes=budget, stats=train_stats, progress=bar.update)
            backend = train_byte_level_bpe(docs, vocab_size, eod_token=eod_token or EOD_TOKEN)
        if train_stats.documents == 0:
            raise _no_documents(inputs, train_stats)
        tok = K3Tokenizer(backend, eod_token=eod_token or EOD_TOKEN)
        if tok.vocab_size > vocab_size:  # cannot happen with the tokenizers trainer; guard anyway
            raise CorpusError(f"trained tokenizer has {tok.vocab_size} ids, more than --vocab-size {vocab_size}")

    # 2. Encode into temporary files, then rename.
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tag = f".tmp-{os.getpid()}-{int(time.time() * 1e6) % 10**9}"
    tmp = {k: v + tag for k, v in paths.items()}
    stats = Stats()
    dtype = DType.optimal_dtype(tok.vocab_size)
    try:
        builder = IndexedDatasetBuilder(tmp["bin"], dtype=dtype)
        with _progress_bar(total_bytes, "tokenize", progress) as bar:
            docs = iter_documents(sources, text_key=text_key, fmt=fmt, on_invalid_utf8=on_invalid_utf8,
                                  max_bytes=max_bytes, stats=stats, progress=bar.update)
            lengths = write_tokens(docs, builder.data_file, tok, dtype, workers=workers,
                                   piece_chars=piece_chars, stats=stats)
        # One sequence per document, as add_item + end_document would record them.
        builder.sequence_lengths.extend(lengths)
        builder.document_indices.extend(range(1, len(lengths) + 1))
        builder.finalize(tmp["idx"])
        if stats.documents == 0:
            raise _no_documents(inputs, stats)
        tok.save(tmp["tokenizer"])
        meta = {
            "format": "megatron-core indexed dataset (MMIDIDX v1)",
            "documents": stats.documents,
            "tokens": stats.tokens,
            "input_bytes": stats.bytes,
            "files": stats.files,
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
            "eod_token": tok.eod_token,
            "max_token_id": stats.max_token_id,
            "dtype": numpy.dtype(dtype).name,
            "tokenizer_fingerprint": tok.fingerprint,
            "tokenizer_source": tokenizer or f"trained byte-level BPE, vocab {vocab_size}",
            "skipped": {"empty": stats.skipped_empty, "binary": stats.skipped_binary,
                        "invalid_utf8": stats.skipped_invalid_utf8},
            "inputs": [str(i) for i in inputs],
        }
        with open(tmp["meta"], "w") as f:
            json.dump(meta, f, indent=1)
        # The .idx goes last: a dataset is only visible once both files are in place.
        for key in ("meta", "tokenizer", "bin", "idx"):
            os.replace(tmp[key], paths[key])
    finally:
        for p in tmp.values():
            if os.path.exists(p):
                os.remove(p)
    return Summary(prefix=output_prefix, tokenizer_path=paths["tokenizer"], vocab_size=tok.vocab_size,
                   eod=tok.eod, seconds=time.time() - t0, stats=stats)


def _file_size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _no_documents(inputs: Sequence[str], stats: Stats) -> CorpusError:
    return CorpusError(f"no documents in corpus {' '.join(map(str, inputs))} "
                       f"({stats.files} files read; {stats.skipped()})")


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m data_prep.{PROG}",
        description="Tokenize JSONL or a directory of text/code files into a Megatron-Core "
                    "indexed dataset (PREFIX.bin/.idx), one EOD token after every document.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                   help="JSONL files (.jsonl/.ndjson/.jsonl.gz), plain files, or directories")
    p.add_argument("--output-prefix", "-o", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json, PREFIX.meta.json")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokenizer", metavar="TOKENIZER",
                   help="use this tokenizer.json or tiktoken BPE file (or HF folder holding one) instead of training one")
    g.add_argument("--vocab-size", type=int, default=512, help="vocab size of the byte-level BPE to train (>= 257)")
    p.add_argument("--eod-token", default=None,
                   help=f"end-of-document token (default {EOD_TOKEN}; for --tokenizer, the first of the usual names found)")
    p.add_argument("--text-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--glob", action="append", metavar="PATTERN",
                   help="file pattern inside directory inputs, repeatable (default '**/*')")
    p.add_argument("--format", dest="fmt", choices=("auto", "jsonl", "text"), default="auto",
                   help="how to read files: auto = JSONL by extension, else one document per file")
    p.add_argument("--on-invalid-utf8", choices=("error", "skip"), default="error",
                   help="stop at the first invalid UTF-8 byte (naming file and offset), or skip that document")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="stop after the document that reaches this many input bytes")
    p.add_argument("--train-max-bytes", type=int, default=200 * 2**20,
                   help="train the BPE on at most this many input bytes")
    p.add_argument("--workers", type=int, default=1,
                   help="encode in this many processes (output identical to 1, which encodes in this one)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = tokenize_corpus(
            args.input, args.output_prefix, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
            eod_token=args.eod_token, text_key=args.text_key, globs=tuple(args.glob or ["**/*"]),
            fmt=args.fmt, on_invalid_utf8=args.on_invalid_utf8, max_bytes=args.max_bytes,
            train_max_bytes=args.train_max_bytes, overwrite=args.overwrite,
            progress=not args.no_progress, workers=args.workers,
        )
    except (CorpusError, FileNotFoundError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
