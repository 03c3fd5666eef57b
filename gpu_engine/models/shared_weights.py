"""The CPU engine's packed weights in one file that the live engine and the standby engine map together.

``blink serve`` keeps a standby engine beside the live one (a spare with its weights loaded, so that a restart
skips the load). Each would hold its own copy of the packed weights (94 MiB for the embedded SmolLM2-135M);
``share`` moves a loaded model's large tensors into a ``MAP_SHARED`` mapping of one file in a folder both
processes see (``BLINK_CPU_WEIGHTS_DIR``, opt-in), so the machine holds them once. It runs when the model is
loaded, before any KV cache or step. The price: the weights are then not on transparent huge pages (this
machine's shared memory has none), which a decode step of the embedded model is ~8% faster with.

The first process to share writes the file (under a temporary name, then renamed into place, so no reader
sees half of it); the next finds it by a digest of the model file's identity and of the tensors' layout, checks
that its bytes are the ones it loaded itself (a changed file or another packing writes a new file instead), and
maps it. Once filled, the mapping is made read-only (``mprotect``): a kernel that wrote into a weight would fault at
once instead of changing the other engine's model. Every tensor object found on
the model's module tree (parameters, buffers, tensors in a module's attributes) is moved with ``Tensor.set_``, so
each reference to it sees the mapping; storages that stayed outside it are counted in the result.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

MIN_BYTES = 1 << 16  # storages smaller than this stay where they are (norm weights, tables of a few KiB)
ALIGN = 4096         # each storage's span starts on its own page in the file
SPAN_ALIGN = 64      # and on a 64-byte boundary of the storage


@dataclasses.dataclass(frozen=True, slots=True)
class Shared:
    path: Path
    shared_bytes: int   # storages now in the mapping
    kept_bytes: int     # storages of at least MIN_BYTES found on the model but left outside it (none expected)
    written: bool       # this process wrote the file (False: it mapped one another process wrote)


def _tensors(root: Any, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor object of the module tree under ``root``: parameters, buffers, and tensors held in plain
    attributes, lists, tuples and dicts of a module (a list holding a module is followed too). Other objects
    (a decode stack's plan, a cache) are not weights and are not followed."""
    seen = set() if seen is None else seen
    if id(root) in seen:
        return []
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        return [root]
    children: list[Any]
    if isinstance(root, (list, tuple)):
        children = list(root)
    elif isinstance(root, dict):
        children = list(root.values())
    elif isinstance(root, nn.Module):
        children = [*root._parameters.values(), *root._buffers.values(), *root._modules.values(),
                    *(v for k, v in vars(root).items() if k not in ("_parameters", "_buffers", "_modules"))]
    else:
        return []
    found: list[torch.Tensor] = []
    for child in children:
        if child is not None:
            found += _tensors(child, seen)
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class _Span:
    """The bytes ``lo:hi`` of ``storage`` that its tensors view. A storage may hold more (the huge-page arena of
    ``cpu_pack.move_to_huge_pages`` starts its buffers at the first 2 MiB boundary of its mapping, a different
    number of bytes in from its start in each process), so only the span goes into the file: two processes that
    loaded the same weights write the same bytes."""
    storage: torch.UntypedStorage
    lo: int
    hi: int

    def bytes(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8).set_(self.storage, self.lo, (self.hi - self.lo,), (1,))


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte range of its storage that ``t`` views (None: it views nothing)."""
    if t.numel() == 0:
        return None
    first = int(t.storage_offset())
    last = first + sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return first * t.element_size(), (last + 1) * t.element_size()


def _layout(tensors: list[torch.Tensor]) -> tuple[list[_Span], list[int], int]:
    """The viewed spans of the distinct CPU storages of at least MIN_BYTES, in the order first met, their
    page-aligned offsets in the file, and its size."""
    ranges: dict[int, tuple[torch.UntypedStorage, int, int]] = {}
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type != "cpu" or s.nbytes() < MIN_BYTES or (extent := _extent(t)) is None:
            continue
        _, lo, hi = ranges.get(s.data_ptr(), (s, *extent))
        ranges[s.data_ptr()] = (s, min(lo, extent[0]), max(hi, extent[1]))
    # a span starts on a 64-byte boundary of its storage: every element size divides its tensors' offsets in
    # the file, and they keep their alignment for the SIMD kernels
    spans = [_Span(s, lo - lo % SPAN_ALIGN, hi) for s, lo, hi in ranges.values()]
    offsets, size = [], 0
    for span in spans:
        offsets.append(size)
        size += -(-(span.hi - span.lo) // ALIGN) * ALIGN
    return spans, offsets, size


def _digest(identity: str, spans: list[_Span]) -> str:
    h = hashlib.sha256(identity.encode())
    for span in spans:
        h.update((span.hi - span.lo).to_bytes(8, "little"))
    return h.hexdigest()[:20]


def _same(mapped: torch.Tensor, spans: list[_Span], offsets: list[int]) -> bool:
    return all(torch.equal(mapped[o: o + span.hi - span.lo], span.bytes())
               for span, o in zip(spans, offsets, strict=True))


def _write(path: Path, spans: list[_Span], offsets: list[int], size: int) -> torch.Tensor:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # the blocks reserved now: a full folder is an OSError here, not a SIGBUS while the mapping fills
        os.posix_fallocate(fd, 0, size)
        mapped = torch.from_file(str(tmp), shared=True, size=size, dtype=torch.uint8)
        for span, o in zip(spans, offsets, strict=True):
            mapped[o: o + span.hi - span.lo].copy_(span.bytes())
        os.replace(tmp, path)  # the mapping stays valid across the rename: it is of the inode
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return mapped


def _private(folder: Path) -> None:
    """The folder must be this user's and closed to others (a file another user can write would change the
    weights an engine maps); OSError otherwise."""
    st = folder.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder}: not this user's, or writable by others (mode {st.st_mode & 0o777:o})")


def share(model: nn.Module, directory: Path, identity: str) -> Shared:
    """Move ``model``'s large CPU tensors into the shared file for ``identity`` (the model file and how it was
    packed) in ``directory``, writing the file where no matching one exists. A decode stack's plan (its
    weights' addresses) is dropped: its next step makes it anew. OSError where the folder is not private or the
    file cannot be written (the model is then unchanged). Files of other models or options stay in the folder
    until removed by hand."""
    tensors = _tensors(model)
    spans, offsets, size = _layout(tensors)
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
    _private(Path(directory))
    path = Path(directory) / f"weights-{_digest(identity, spans)}.bin"
    mapped, written = None, False
    if path.is_file() and path.stat().st_size == size:
        candidate = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        if _same(candidate, spans, offsets):
            mapped = candidate
    if mapped is None:
        mapped, written = _write(path, spans, offsets, size), True
    _read_only(mapped)
    base = {span.storage.data_ptr(): o - span.lo for span, o in zip(spans, offsets, strict=True)}
    target = mapped.untyped_storage()
    with torch.no_grad():
        for t in tensors:
            shift = base.get(t.untyped_storage().data_ptr())
            if shift is None:
                continue
            start = shift + t.storage_offset() * t.element_size() if t.numel() else 0  # an empty one views nothing
            t.set_(target, start // t.element_size(), t.size(), t.stride())
    del spans
    if (stack := getattr(model, "decode_stack", None)) is not None:
        stack.forget_plan()
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(model)
            if t.untyped_storage().nbytes() >= MIN_BYTES and t.device.type == "cpu"
            and t.untyped_storage().data_ptr() != target.data_ptr()}
    return Shared(path, size, sum(kept.values()), written)


def _read_only(mapped: torch.Tensor) -> None:
    """mprotect the mapping to PROT_READ (it starts on a page: mmap's own address)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if mapped.data_ptr() % mmap.PAGESIZE or libc.mprotect(mapped.data_ptr(), mapped.numel(), mmap.PROT_READ):
        raise OSError(ctypes.get_errno(), "cannot make the shared weights read-only")


def identity_of(path: Path, *parts: object) -> str:
    """What a shared file is of: the model file (path, size, modification time) and the packing's options."""
    st = path.stat()
    return "|".join([str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), *map(str, parts)])
