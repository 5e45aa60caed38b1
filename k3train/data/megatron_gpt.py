"""The GPTDataset subclass k3train builds through Megatron-Core (imports megatron.core)."""

from __future__ import annotations

import copy
import hashlib
import os

from megatron.core.datasets.gpt_dataset import GPTDataset


def data_fingerprint(prefix: str) -> str:
    """Identity of a .bin/.idx pair on disk: path, sizes, mtimes, inodes."""
    h = hashlib.sha256(os.path.abspath(prefix).encode())
    for ext in (".bin", ".idx"):
        st = os.stat(prefix + ext)
        h.update(f"|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode())
    return h.hexdigest()[:16]


class K3GPTDataset(GPTDataset):
    """A GPTDataset whose index cache lives in ``config.k3_index_cache_root/<fingerprint>``.

    Keying the cache by the files' fingerprint means a dataset rebuilt under the same
    prefix never reuses stale sample indices. The blend-level config keeps
    ``path_to_cache=None`` (Megatron-Core 0.16.1's BlendedDataset needs a process group
    to write its cache).
    """

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config):
        root = getattr(config, "k3_index_cache_root", None)
        if root is not None and dataset_path is not None:
            config = copy.copy(config)
            config.path_to_cache = os.path.join(root, data_fingerprint(dataset_path))
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
