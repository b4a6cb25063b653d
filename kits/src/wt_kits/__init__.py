"""wt-kits: optional helpers a backend may build on. wt-core does not import them (its
conformance suite does, for fault injection: `weight_transfer.testing.seams`).

- `wt_kits.group`: a private process group between trainer rank 0 and the
  workers (`StatelessGroup`), its authenticated store, and the rendezvous
  both sides run (`trainer_rendezvous` / `join_group`).
- `wt_kits.stream`: bucketed streaming: the packing layout both ends derive
  (`plan_buckets`), packing and unpacking, the send window and the load
  pipeline, and per-piece digests of the bytes on the wire.
- `wt_kits.colocated`: named shared memory and a control link over a Unix
  socket, for a trainer and workers on one host.
- `wt_kits.slices`: the recorded slices of a dry run and their replay, for a
  backend whose producers send each worker only what it loads.
- `wt_kits.channel`: `GroupChannel`, the one group or link a side holds, and
  why it is gone when it is.
"""
