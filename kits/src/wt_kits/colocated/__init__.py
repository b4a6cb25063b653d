"""A trainer and workers on one host: named shared memory and a control link.

`SharedSegment` holds the bytes (`/dev/shm`, mode 0600, unguessable names);
`LocalListener` / `connect_local` open a `LocalLink` of fixed-size `Frame`s
over a Unix socket whose peer is checked by the kernel; `Credits` turns the
worker's `RELEASED` frames into futures the trainer waits on.
"""

from wt_kits.colocated.link import (
    RELEASED,
    Credits,
    Frame,
    LinkClosed,
    LocalLink,
    LocalListener,
    connect_local,
)
from wt_kits.colocated.shm import SharedSegment

__all__ = [
    "RELEASED",
    "Credits",
    "Frame",
    "LinkClosed",
    "LocalLink",
    "LocalListener",
    "SharedSegment",
    "connect_local",
]
