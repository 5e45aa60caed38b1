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
  * ``PREFIX.tokenizer.json``: the tokenizer (trained, or a copy of ``--tokenizer``);
  * ``PREFIX.meta.json``: counts, vocab size, EOD id, the largest token id.

Files are written under temporary names and renamed at the end, so a failed or
interrupted run leaves any earlier output as it was. An existing output is only
replaced with ``--overwrite``.

Policy for text that is not valid UTF-8 (``--on-invalid-utf8``):
  * ``error`` (default): stop with the file, line and byte offset of the first bad byte;
  * ``skip``: drop that document and report the count in the summary.
Empty (whitespace-only) documents and binary files (a NUL byte) are skipped and counted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

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
) -> Summary:
    """Tokenize ``inputs`` into ``output_prefix``.{bin,idx,tokenizer.json,meta.json}.

    With ``tokenizer`` None, trains a byte-level BPE of ``vocab_size`` on the first
    ``train_max_bytes`` of the corpus. Raises ``CorpusError`` (a ValueError) with a
    one-line message on bad input; earlier output is never touched on failure.
    """
    t0 = time.time()
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
    import torch
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
            batch: list[str] = []
            for text in docs:
                batch.append(text)
                if len(batch) == ENCODE_BATCH_DOCS:
                    _add_batch(builder, tok, batch, stats, numpy, torch)
                    batch = []
            if batch:
                _add_batch(builder, tok, batch, stats, numpy, torch)
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


def _add_batch(builder, tok: K3Tokenizer, batch: list[str], stats: Stats, numpy, torch) -> None:
    for ids in tok.encode_batch(batch):
        arr = numpy.asarray(ids + [tok.eod], dtype=numpy.int64)
        builder.add_item(torch.from_numpy(arr))
        builder.end_document()
        stats.tokens += arr.size
        stats.max_token_id = max(stats.max_token_id, int(arr.max()))


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
    g.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="use this tokenizer.json instead of training one")
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
            progress=not args.no_progress,
        )
    except (CorpusError, FileNotFoundError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
