"""The suite itself lives in wt-core (`weight_transfer.testing.conformance`)."""

from weight_transfer.testing.conformance import *  # noqa: F403
