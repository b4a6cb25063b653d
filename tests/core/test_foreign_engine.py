"""A wt trainer pointed at an engine running vLLM's own weight transfer."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tests.core.helpers import ExampleNet
from weight_transfer import ForeignEngineError, ModuleSource, WeightTransferTrainerFactory
from wt_kits.group import free_port

pytest.importorskip("vllm")


class OwnEngineHost:
    """What a vLLM worker does with an init payload: its engine parses it, then inits.
    The engine is vLLM's own class, uninitialized: its `parse_init_info` refuses a wt
    payload before anything else runs (vLLM's nccl and ipc engines need CUDA to start)."""

    def __init__(self, engine_cls: type) -> None:
        self.engine = object.__new__(engine_cls)
        self.inits = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))
        self.inits += 1


def _port_is_free(port: int) -> bool:
    """Whether a new store could listen on `port` (as the store binds: reusing the
    address, so connections of the old one in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_trainer_at_vllms_own_engine_fails_before_init_naming_it_and_the_wt_backend(
    backend: str,
) -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    pytest.importorskip(f"wt_{backend}")
    engine_cls = {"nccl": NCCLWeightTransferEngine, "ipc": IPCWeightTransferEngine}[backend]
    host = OwnEngineHost(engine_cls)
    info_cls = WeightTransferTrainerFactory.get_engine_class(backend).init_info_cls
    port = free_port()
    common: dict[str, Any] = {"timeout_s": 10.0}
    if backend == "nccl":
        info = info_cls("127.0.0.1", port, 2, rank=0, **common)  # type: ignore[call-arg]
    else:
        info = info_cls(rank=0, num_workers=1, device="cpu", **common)  # type: ignore[call-arg]
    source = ModuleSource(ExampleNet())
    with pytest.raises(ForeignEngineError) as refused:
        WeightTransferTrainerFactory.trainer_init(info, client=host, source=source)
    message = str(refused.value)
    assert engine_cls.__name__ in message, message
    assert f'{{"backend": "wt_{backend}"}}' in message, message
    assert host.inits == 0  # refused in its parse: nothing of the engine was initialized
    if backend == "nccl":
        assert _port_is_free(port), "the trainer kept its rendezvous port after the refusal"
