"""The embedded default corpus: this Python's own standard library sources.

It needs no download, so a fresh machine can train at once. The subset is
deterministic for a given Python installation: every ``.py`` file under
``sysconfig.get_paths()['stdlib']`` outside test suites, demos and site-packages,
at most ``MAX_FILE_BYTES`` each, sorted by a hash of their relative path (a fixed
pseudo-random order that spreads the subset over the library), until ``MAX_BYTES``
of source is taken. Each file is one document. It is tokenized with a byte-level BPE
trained on the same files.

``ensure_default_dataset`` builds it once into ``<cache_dir>/default_corpus/<name>``
(the name carries the Python version, the vocab size and a fingerprint of the file
list) and reuses it afterwards. The build goes to a temporary folder that is renamed
into place, under an exclusive lock file, so processes that race (several ranks on
one node, or two runs) build it once and never see a half-written dataset. On
several nodes with a shared file system whose locks are unreliable, let global rank 0
call it first and barrier, as the training loop does.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import sysconfig
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

# Bump when the selection or the tokenization changes: old caches are then ignored.
CORPUS_VERSION = 1
MAX_BYTES = 4 * 2**20
MAX_FILE_BYTES = 256 * 2**10
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo",
    "__pycache__", "lib2to3", "ensurepip", "pydoc_data", "encodings",
})
PREFIX_NAME = "stdlib"


def stdlib_files(max_bytes: Optional[int] = None, root: Optional[str] = None) -> list[Path]:
    """The deterministic list of standard-library files that make up the corpus."""
    max_bytes = MAX_BYTES if max_bytes is None else int(max_bytes)
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {base}; set data.paths to a dataset")
    candidates = []
    for dirpath, dirnames, filenames in os.walk(base):
        # prune excluded folders instead of walking them (site-packages can be huge)
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(("config-", "."))]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            p = Path(dirpath) / name
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if 0 < size <= MAX_FILE_BYTES:
                key = hashlib.sha256(p.relative_to(base).as_posix().encode()).hexdigest()
                candidates.append((key, p, size))
    # A fixed pseudo-random order (by path hash) spreads the subset over the whole library.
    candidates.sort(key=lambda c: c[0])
    out, total = [], 0
    for _, p, size in candidates:
        if total >= max_bytes:
            break
        out.append(p)
        total += size
    if not out:
        raise FileNotFoundError(f"no Python sources found under {base}; set data.paths to a dataset")
    return out


def _fingerprint(files: list[Path], vocab_size: int, root: Path) -> str:
    h = hashlib.sha256(f"v{CORPUS_VERSION}|{vocab_size}|{sys.version_info[:3]}".encode())
    for f in files:
        h.update(f"|{f.relative_to(root).as_posix()}:{f.stat().st_size}".encode())
    return h.hexdigest()[:12]


def default_dataset_dir(cache_dir: str, vocab_size: int, max_bytes: Optional[int] = None,
                        files: Optional[list[Path]] = None) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(max_bytes) if files is None else files
    name = (f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-v{vocab_size}-"
            f"{_fingerprint(files, vocab_size, root)}")
    return Path(resolve_cache_dir(cache_dir)) / "default_corpus" / name


def resolve_cache_dir(cache_dir: Optional[str]) -> str:
    """Expand ``~`` and the schema's unresolved default (``${oc.env:K3TRAIN_CACHE,...}``)
    when the config was built in Python without Hydra."""
    if not cache_dir or str(cache_dir).startswith("${"):
        cache_dir = os.environ.get("K3TRAIN_CACHE") or "~/.cache/k3train"
    return os.path.abspath(os.path.expanduser(str(cache_dir)))


def _complete(d: Path) -> bool:
    p = d / PREFIX_NAME
    return all(os.path.isfile(f"{p}{ext}") for ext in (".bin", ".idx", ".tokenizer.json"))


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_default_dataset(cache_dir: str, vocab_size: int, *, max_bytes: Optional[int] = None,
                           progress: bool = True) -> tuple[str, str]:
    """Build the default corpus once (idempotent, atomic, race-safe); return
    ``(prefix, tokenizer_path)``. ``vocab_size`` must be at most the model's vocab."""
    from k3train.data.tokenizer import MIN_BYTE_BPE_VOCAB

    if vocab_size < MIN_BYTE_BPE_VOCAB:
        raise ValueError(f"the default corpus needs vocab_size >= {MIN_BYTE_BPE_VOCAB} (byte-level BPE), "
                         f"got {vocab_size}; raise model.vocab_size or set data.paths")
    max_bytes = MAX_BYTES if max_bytes is None else int(max_bytes)
    files = stdlib_files(max_bytes)
    final = default_dataset_dir(cache_dir, vocab_size, max_bytes, files)
    prefix = str(final / PREFIX_NAME)
    tok_path = f"{prefix}.tokenizer.json"
    if _complete(final):
        return prefix, tok_path
    with _file_lock(final.parent / ".lock"):
        if _complete(final):  # another process built it while we waited
            return prefix, tok_path
        from data_prep.tokenize_corpus import tokenize_corpus

        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            print(f"[k3train.data] building the default corpus (Python stdlib, vocab {vocab_size}) "
                  f"into {final}", file=sys.stderr, flush=True)
            summary = tokenize_corpus([str(f) for f in files], str(tmp / PREFIX_NAME), vocab_size=vocab_size,
                                      fmt="text", progress=progress)
            if final.exists():  # an incomplete leftover from an older crash
                shutil.rmtree(final)
            os.rename(tmp, final)
            print(f"[k3train.data] {summary.line()}".replace(str(tmp), str(final)), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return prefix, tok_path
