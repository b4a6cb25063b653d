"""wt backend `ipc` (skeleton: no engines yet)."""
