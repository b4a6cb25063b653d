"""Registration of wt worker engines into vLLM's weight-transfer factory.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it once in
each of its processes (front end, engine core, workers). For every worker
engine wt knows (`WeightTransferEngineFactory.available_backends()`: installed
entry points and in-process registrations, read without importing them) it
registers `wt_<name>` in vLLM's factory in vLLM's lazy form: the module
`weight_transfer.vllm.engines` resolves the class through wt's registry when
vLLM creates the engine, so a backend's module is imported only then.

Names vLLM already knows (its own backends, or an earlier call) are left
alone, so calling `register()` again is harmless and picks up backends
registered since.

It also registers vLLM as wt-core's host in this process (`host.VLLMHost`: a
worker engine's loader and generation), starts the process's generation
service (`serving.serve_generation`), through which a worker in a process of
its own reaches its engine core to resume generation after a round that lost
its trainer, and installs wt's wrappers of vLLM's entry points
(`patches.install`: finishes carry their label to the workers; requests on
wt adapters are admitted only while served), its round metrics (`metrics.
install`: the engine core answers its workers' totals, an API server publishes
them on `/metrics`) and, in an API server, into its
OpenAI handlers (`versions.install`: each choice says which weight versions
made its tokens).
"""

from __future__ import annotations

import logging
import sys

from weight_transfer.vllm import BACKEND_PREFIX

__all__ = ["register", "vllm_backend_name"]

logger = logging.getLogger("weight_transfer.vllm")

ENGINES_MODULE = "weight_transfer.vllm.engines"
API_SERVER_MODULE = "vllm.entrypoints.launchers.app"  # imported by vLLM's API servers


def vllm_backend_name(name: str) -> str:
    """The name a wt backend has in vLLM: `nccl` -> `wt_nccl`."""
    return f"{BACKEND_PREFIX}{name}"


def register() -> list[str]:
    """Register every wt worker engine in vLLM's factory; returns the names added."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory as VLLMEngineFactory,
    )

    from weight_transfer.factory import WeightTransferEngineFactory

    added = []
    for name in WeightTransferEngineFactory.available_backends():
        vllm_name = vllm_backend_name(name)
        if vllm_name in VLLMEngineFactory._registry:
            continue
        VLLMEngineFactory.register_engine(vllm_name, ENGINES_MODULE, vllm_name)
        added.append(vllm_name)
    if added:
        logger.debug("wt backends registered in vLLM: %s", ", ".join(added))
    from weight_transfer.runtime.hosts import register_host
    from weight_transfer.vllm import metrics, patches
    from weight_transfer.vllm.host import VLLMHost
    from weight_transfer.vllm.serving import serve_generation

    register_host(VLLMHost())
    serve_generation()
    patches.install()
    metrics.install()
    if API_SERVER_MODULE in sys.modules:  # an API server (not its engine's processes)
        from weight_transfer.vllm import versions

        versions.install()
    return added
