"""Values derived from a tensor, computed once per tensor object and version.

The model passes one ``cu_seqlens`` tensor to every KDA layer of a forward; what KDA derives from
it (the checked offsets on the host, the int64 copy on the device, the chunk tables) is the same
for every layer. ``TensorMemo.get(t, key, make)`` returns ``make()`` for the first call on ``t``
and the remembered value while ``t`` is alive, unmodified in place (its version counter) and asked
with the same ``key``. Entries hold ``t`` weakly; those of dead tensors are dropped as new ones come.
A value must not refer to ``t`` itself (``t`` would never die). Not for use while
``torch.compile`` traces (the caller computes directly then).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable

import torch


class TensorMemo:
    def __init__(self, size: int = 64):
        self._size = size
        self._entries: dict[int, tuple[weakref.ref, int, Hashable, Any]] = {}

    def get(self, t: torch.Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
        hit = self._entries.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] == key:
            return hit[3]
        value = make()
        if len(self._entries) >= self._size:
            for dead in [k for k, entry in self._entries.items() if entry[0]() is None]:
                del self._entries[dead]
        self._entries[id(t)] = (weakref.ref(t), t._version, key, value)
        return value
