"""wt backend `sharded_rdt` (skeleton: no engines yet)."""
