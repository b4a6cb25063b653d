"""wt-core's runtime: how core keeps the contract, on both sides of a round.

A backend author reads the contract (`weight_transfer.backend` and the
modules it names); these modules implement what the contract promises and
need not be read to write a backend:

- `worker_round`: the worker's transaction, controls and watchdog that every
  `WeightTransferEngine` inherits;
- `round_client`: the client as a trainer engine sees it (signing, the update
  in flight, aborts of failed rounds);
- `control`: the control fields, the MAC, refusal codes and the three ways
  through a round;
- `hosts`: the inference host a worker runs in (its loader, its generation);
- `direct_loader`: the loader outside any host;
- `waiting`, `limits`, `devices`, `phases`, `slices` (the dry run), and the
  lifecycle hooks (`hooks`, `hookspecs`).
"""
