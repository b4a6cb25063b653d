"""Named POSIX shared-memory segments between colocated processes (Linux `/dev/shm`).

Creator: `SharedSegment.create(nbytes)` makes `/dev/shm/wt-<pid>-<32 hex>`:
the creator's pid and 128 random bits, opened with `O_CREAT | O_EXCL` and
mode 0600, so the name is unguessable, never an existing file, and readable
by the creator's user only. Its pages are reserved at creation, so a full
`/dev/shm` is a `ValueError` then, never a `SIGBUS` at the first write.
`unlink()` removes the name while every mapping stays valid: once each
reader has attached, unlinking leaves nothing in `/dev/shm`, whichever
process dies later (the kernel frees the memory with the last mapping).

Reader: `SharedSegment.attach(name, nbytes, owner_pid=..., owner_uid=...)`
checks, before it maps anything, that the name has the creator's form, that
the pid in it is `owner_pid` (the process the reader knows as its peer), and
that the file belongs to `owner_uid`, has mode 0600 and holds at least
`nbytes`. Each refusal is a `ValueError` naming what was wrong.

`tensor` is a `uint8` tensor over the whole mapping, which torch owns: the
mapping lives exactly as long as the last view of it, so `close()` can never
unmap memory a loader still reads. Nothing here goes through
`multiprocessing`'s resource tracker, which would unlink segments it did not
create.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat

import torch

__all__ = ["SharedSegment", "SHM_DIR", "segment_name_pid"]

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"wt-(\d{1,10})-[0-9a-f]{32}")


def segment_name_pid(name: str) -> int | None:
    """The creator pid in a segment name of this module's form, else None."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


class SharedSegment:
    """One mapped segment; see the module docstring."""

    def __init__(self, name: str, nbytes: int, fd: int, *, owner: bool) -> None:
        """Map the open file `fd` (the caller closes it) as this segment."""
        self.name = name
        self.nbytes = nbytes
        self.owner = owner
        # Through /proc/self/fd: the very file checked or created, not whatever the name
        # points at by now.
        self.tensor = torch.from_file(
            f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8
        )
        self._linked = owner

    @classmethod
    def create(cls, nbytes: int) -> SharedSegment:
        """A new segment of `nbytes` (> 0), named for this process, mode 0600."""
        if nbytes <= 0:
            raise ValueError(f"a shared segment needs a positive size, got {nbytes}")
        name = f"wt-{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # reserve the pages now: a full /dev/shm fails here, not as SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
                raise ValueError(
                    f"cannot reserve a shared segment of {nbytes} bytes in {SHM_DIR} "
                    f"({free} bytes free): {e}"
                ) from None
            return cls(name, nbytes, fd, owner=True)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(
        cls, name: str, nbytes: int, *, owner_pid: int, owner_uid: int, field: str = "name"
    ) -> SharedSegment:
        """Map the segment `name` of process `owner_pid`; see the module docstring."""
        pid = segment_name_pid(name)
        if pid is None:
            raise ValueError(
                f"field {field!r}: {name!r} is not a wt segment name (wt-<pid>-<32 hex digits>)"
            )
        if pid != owner_pid:
            raise ValueError(
                f"field {field!r}: segment {name!r} belongs to process {pid}, not to the "
                f"trainer (pid {owner_pid}) on the control connection"
            )
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValueError(f"field {field!r}: segment {name!r} does not exist") from None
        try:
            info = os.fstat(fd)
            mode = stat.S_IMODE(info.st_mode)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != owner_uid or mode != 0o600:
                raise ValueError(
                    f"field {field!r}: segment {name!r} is not a private segment of user "
                    f"{owner_uid} (owner {info.st_uid}, mode {mode:o})"
                )
            if info.st_size < nbytes:
                raise ValueError(
                    f"field {field!r}: segment {name!r} holds {info.st_size} bytes, fewer "
                    f"than the {nbytes} declared"
                )
            return cls(name, nbytes, fd, owner=False)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name (the creator, once every reader has attached); idempotent."""
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        """Unlink (if the creator) and drop this object's hold on the mapping.

        The mapping goes with its last view: at once if nothing else views it,
        later if a loader still does; never under a live view.
        """
        self.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)
