"""The C heap between decoder layers: what glibc's malloc keeps resident after tensors are freed.

Every layer allocates and frees activation-sized tensors (tens to hundreds of MB). glibc raises its mmap threshold
(up to 32 MiB) as large blocks are freed, so later ones come from the heap, and freed heap memory stays in the
resident set: the peak of an in-memory GPTQ run of SmolLM2 crept from 1,601 MiB after layer 1 to 2,249 MiB by
layer 25. Two remedies, at two prices (SmolLM2 GPTQ, 128×512 calibration tokens):

* ``trim_heap`` once per layer (the engine does, for every run): a 1,812 MiB peak, for 2.6 % more time;
* ``bound_heap`` (streamed runs, for models larger than memory): every large block gets its own mapping, returned
  when freed, so the peak is about what is live (another 0.6 GiB less on 6 layers), but each new block is
  page-faulted in again: a third more time on a model this small, less where layers compute more per byte.

Nothing happens where glibc is not the C library.
"""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def trim_heap() -> None:
    """Hand the heap's freed memory back to the OS (``malloc_trim``: free pages anywhere in the heap, not only at its
    top)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def bound_heap(threshold: int = 2**20) -> None:
    """Serve every allocation of ``threshold`` bytes or more from its own mapping, returned to the OS when freed (a
    3B model's streamed GPTQ peak crept by 200 MiB over 5 layers without it, and stayed flat with it)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass
