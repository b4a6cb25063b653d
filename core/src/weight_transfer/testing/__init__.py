"""Testing a backend: real worker processes, and the conformance suite every backend runs.

A backend ships a `Profile` (how to build its trainer's init info, its wire
modes) and runs, with the backend installed:

    pytest -p weight_transfer.testing.plugin --pyargs weight_transfer.testing.conformance \
        --wt-profile my_backend.conformance:PROFILE

- `weight_transfer.testing.workers`: `WorkerPool(backend, n)`, worker processes
  whose engines come from the factory, reached over loopback sockets.
- `weight_transfer.testing.models`: the weights and model the suite syncs,
  and sources that keep or break the source contract.
- `weight_transfer.testing.conformance`: the suite.
"""

from weight_transfer.testing.profile import Profile

__all__ = ["Profile"]
