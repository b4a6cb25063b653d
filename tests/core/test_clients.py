"""Clients against real counterparts: an HTTP server on loopback, an LLM-shaped object."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.core.helpers import ExampleNet, expected_digests
from tests.harness import RecordingModel, digest
from weight_transfer import (
    FanOutClient,
    HTTPVLLMWeightSyncClient,
    LocalVLLMWeightSyncClient,
    ModuleSource,
    VLLMWeightSyncClient,
    WeightSyncRPCError,
    WeightTransferConfig,
    WeightTransferEngineFactory,
    WeightTransferInitRequest,
    WeightTransferTrainerFactory,
    WeightTransferUpdateRequest,
    WorkerSession,
)
from weight_transfer.runtime.control import SEAL_FIELD


@dataclass
class Server:
    url: str
    seen: list[tuple[str, str, Any]] = field(default_factory=list)
    # route -> (status, body as bytes) to answer instead of 200 {}
    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    delay_s: dict[str, float] = field(default_factory=dict)
    weight_version: str = "v0"


@pytest.fixture
def server() -> Iterator[Server]:
    state = Server(url="")

    class Handler(BaseHTTPRequestHandler):
        def _handle(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            state.seen.append((method, self.path, body))
            time.sleep(state.delay_s.get(self.path, 0.0))
            if self.path in state.answers:
                status, payload = state.answers[self.path]
            elif method == "GET" and self.path == "/weight_info":
                status, payload = 200, json.dumps({"weight_version": state.weight_version}).encode()
            else:
                if self.path == "/finish_weight_update" and body:
                    state.weight_version = body["weight_version"]
                status, payload = 200, b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            self._handle("POST")

        def do_GET(self) -> None:
            self._handle("GET")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


# ---------------------------------------------------------------------- HTTP


def test_http_client_speaks_the_four_routes(server: Server) -> None:
    client = HTTPVLLMWeightSyncClient(server.url, timeout=10)
    assert isinstance(client, VLLMWeightSyncClient)
    assert client.timeout == 10 and client.base_url == server.url.rstrip("/")
    init = {"wire_protocol": 1, "master_port": 1234, "names": ["a", "b"]}
    update = [{"names": ["x"], "shapes": [[2, 3]]}, {"names": ["y"], "shapes": [[1]]}]
    client.init_weight_transfer_engine(init)
    client.start_weight_update()
    client.update_weights(update)
    client.finish_weight_update()
    client.start_weight_update()
    client.update_weights({"names": []})
    client.finish_weight_update(weight_version="step-42")
    assert server.seen == [
        ("POST", "/init_weight_transfer_engine", {"init_info": init}),
        ("POST", "/start_weight_update", None),
        ("POST", "/pause?mode=keep", None),
        ("POST", "/update_weights", {"update_info": update}),
        ("POST", "/finish_weight_update", None),
        ("POST", "/reset_prefix_cache?reset_running_requests=true", None),
        ("POST", "/resume", None),
        ("POST", "/start_weight_update", None),
        ("POST", "/pause?mode=keep", None),
        ("POST", "/update_weights", {"update_info": {"names": []}}),
        ("POST", "/finish_weight_update", {"weight_version": "step-42"}),
        ("POST", "/reset_prefix_cache?reset_running_requests=true", None),
        ("POST", "/resume", None),
    ]
    HTTPVLLMWeightSyncClient(
        server.url, timeout=10, reset_prefix_cache=False, pause=None
    ).finish_weight_update()
    assert server.seen[-1] == ("POST", "/finish_weight_update", None)
    assert client.weight_version() == "step-42"
    server.seen.clear()
    client.start_draft_weight_update()
    client.shutdown_weight_transfer_engine()
    assert [s[1] for s in server.seen] == [
        "/start_draft_weight_update",
        "/pause?mode=keep",
        "/shutdown_weight_transfer_engine",
    ]
    client.close()


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_http_client_resumes_after_every_round_that_the_workers_closed(
    server: Server, mode: str
) -> None:
    client = HTTPVLLMWeightSyncClient(server.url, timeout=10, pause=mode)  # type: ignore[arg-type]
    server.answers["/update_weights"] = (500, b'{"error": "bad name"}')
    client.start_weight_update()
    with pytest.raises(WeightSyncRPCError, match="bad name"):
        client.update_weights({"names": ["x"]})
    server.answers["/start_weight_update"] = (500, b'{"error": "already active"}')
    with pytest.raises(WeightSyncRPCError, match="already active"):
        client.start_weight_update()
    del server.answers["/start_weight_update"]
    server.answers["/finish_weight_update"] = (500, b'{"error": "finalize failed"}')
    client.start_weight_update()
    with pytest.raises(WeightSyncRPCError, match="finalize failed"):
        client.finish_weight_update()
    routes = [s[1] for s in server.seen]
    assert routes == [
        "/start_weight_update", f"/pause?mode={mode}", "/update_weights", "/resume",
        "/start_weight_update",  # refused: it opened nothing, so nothing was paused
        "/start_weight_update", f"/pause?mode={mode}", "/finish_weight_update", "/resume",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="pause must be one of keep, wait, abort or None"):
        HTTPVLLMWeightSyncClient(server.url, pause="later")  # type: ignore[arg-type]


def test_http_client_leaves_an_incomplete_model_paused(server: Server) -> None:
    """An engine that could not roll back (no undo record) says
    `Refusal.MODEL_INCOMPLETE`: no resume after that refusal, and the next
    complete round resumes."""
    from weight_transfer.runtime.control import Refusal

    client = HTTPVLLMWeightSyncClient(server.url, timeout=10, reset_prefix_cache=False)
    said = Refusal.MODEL_INCOMPLETE.say("a round failed after it loaded")
    server.answers["/update_weights"] = (500, json.dumps({"error": said}).encode())
    client.start_weight_update()
    with pytest.raises(WeightSyncRPCError, match=re.escape(said)):
        client.update_weights({"names": ["x"]})
    del server.answers["/update_weights"]
    client.start_weight_update()
    client.update_weights({"names": ["x"]})
    client.finish_weight_update()
    assert [s[1] for s in server.seen] == [
        "/start_weight_update", "/pause?mode=keep", "/update_weights",
        "/start_weight_update", "/pause?mode=keep", "/update_weights", "/finish_weight_update",
        "/resume",
    ]  # fmt: skip


def test_http_client_points_an_adapter_name_at_the_synced_adapter(server: Server) -> None:
    """After each adapter round: `/v1/models` read; the name registered with the
    wt path when it is not listed (the first sync, a restarted server), pointed back
    (`load_inplace`) when listed with another path (a caller registered or
    re-registered it), left alone when it points at the adapter; a removal
    unregisters the name and every alias of its path, and a server that no longer
    knows a name (404) is no error."""
    from weight_transfer import Adapter

    client = HTTPVLLMWeightSyncClient(server.url, timeout=10)
    adapter = Adapter("policy", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    ours = "wt-adapter:policy"

    def listing(**roots: str) -> None:
        cards = [{"id": "base", "root": "/models/base"}]
        cards += [{"id": n, "root": r} for n, r in roots.items()]
        server.answers["/v1/models"] = (200, json.dumps({"data": cards}).encode())

    def posted() -> list[tuple[str, Any]]:
        return [(path, body) for method, path, body in server.seen if method == "POST"]

    listing()
    client.adapter_landed(adapter)  # first sync: registered under the wt-adapter path
    assert posted() == [("/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": ours})]
    listing(policy=ours)
    client.adapter_landed(adapter)  # listed with its path: nothing posted
    assert len(posted()) == 1
    listing(policy="/tmp/someone-elses-adapter")
    client.adapter_landed(adapter)  # squatted: pointed back in place
    assert posted()[-1] == (
        "/v1/load_lora_adapter",
        {"lora_name": "policy", "lora_path": ours, "load_inplace": True},
    )
    listing()
    client.adapter_landed(adapter)  # a restarted server lost the name: registered again
    assert posted()[-1] == ("/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": ours})
    server.seen.clear()
    listing(policy=ours, alias=ours, other="/tmp/other")
    server.answers["/v1/unload_lora_adapter"] = (404, b'{"error": {"message": "not found"}}')
    client.adapter_landed(Adapter("policy", remove=True))
    assert posted() == [
        ("/v1/unload_lora_adapter", {"lora_name": "policy"}),
        ("/v1/unload_lora_adapter", {"lora_name": "alias"}),
    ]
    server.answers["/v1/unload_lora_adapter"] = (500, b'{"error": {"message": "boom"}}')
    with pytest.raises(WeightSyncRPCError, match="boom"):
        client.adapter_landed(Adapter("policy", remove=True))


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (
            {"error": {"message": "update_weights: field 'names' is missing", "code": 400}},
            "update_weights: field 'names' is missing",
        ),
        ({"error": "plain string error"}, "plain string error"),
        ({"detail": "fastapi says no"}, "fastapi says no"),
    ],
)
def test_http_error_carries_the_servers_message_and_status(
    server: Server, payload: dict[str, Any], detail: str
) -> None:
    server.answers["/update_weights"] = (500, json.dumps(payload).encode())
    client = HTTPVLLMWeightSyncClient(server.url, timeout=10)
    with pytest.raises(WeightSyncRPCError) as err:
        client.update_weights({"names": ["a"]})
    e = err.value
    assert (e.method, e.status) == ("update_weights", 500)
    assert e.detail == detail
    assert str(e).startswith("update_weights failed on the inference side (HTTP 500): ")
    assert detail in str(e)


def test_http_error_with_a_non_json_body(server: Server) -> None:
    server.answers["/start_weight_update"] = (409, b"a round is already active")
    client = HTTPVLLMWeightSyncClient(server.url, timeout=10)
    with pytest.raises(WeightSyncRPCError, match=r"\(HTTP 409\): a round is already active") as err:
        client.start_weight_update()
    assert err.value.status == 409


def test_http_timeout_raises_rpc_error(server: Server) -> None:
    server.delay_s["/start_weight_update"] = 1.5
    server.delay_s["/update_weights"] = 1.5
    client = HTTPVLLMWeightSyncClient(server.url, timeout=0.3, update_timeout=5.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncRPCError) as err:
        client.start_weight_update()
    assert time.monotonic() - t0 < 1.4
    assert err.value.method == "start_weight_update" and err.value.status is None
    assert "Timeout" in err.value.detail
    client.update_weights({"names": []})  # the longer update timeout applies to update_weights


def test_http_calls_from_several_threads_survive_each_others_reconnects(server: Server) -> None:
    """An error answer makes the client drop its connections (a new `httpx.Client`);
    a call of another thread that meets the old client before sending is sent again
    on the new one, never failing with the old client's 'closed' error."""
    server.answers["/start_weight_update"] = (500, b'{"detail": "refused"}')
    client = HTTPVLLMWeightSyncClient(server.url, timeout=10)
    unexpected: list[str] = []

    def calls(route: str) -> None:
        for _ in range(40):
            try:
                client._request("POST", route)
            except WeightSyncRPCError as e:
                if not (route == "/start_weight_update" and e.status == 500):
                    unexpected.append(f"{route}: {e}")
            except Exception as e:
                unexpected.append(f"{route}: {type(e).__name__}: {e}")

    threads = [
        threading.Thread(target=calls, args=(route,))
        for route in ["/start_weight_update", "/update_weights"] * 3
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert unexpected == []
    assert sum(1 for _, path, _ in server.seen if path == "/update_weights") == 120


def test_http_unreachable_server_raises_rpc_error() -> None:
    from wt_kits.group.stateless import free_port

    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{free_port()}", timeout=5)
    with pytest.raises(WeightSyncRPCError, match="init_weight_transfer_engine failed"):
        client.init_weight_transfer_engine({})


# --------------------------------------------------------------------- Local


class LLMShaped:
    """The four RL methods of `vllm.LLM`: request objects or their dict form, in front of a
    `WorkerSession` holding a real worker engine."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(
        self, request: WeightTransferInitRequest | dict[str, Any]
    ) -> None:
        if isinstance(request, dict):
            request = WeightTransferInitRequest(**request)
        self.calls.append(("init", request.init_info))
        self.session.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))
        self.session.start_weight_update()

    def update_weights(self, request: WeightTransferUpdateRequest | dict[str, Any]) -> None:
        if isinstance(request, dict):
            request = WeightTransferUpdateRequest(**request)
        self.calls.append(("update", request.update_info))
        self.session.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))
        self.session.finish_weight_update(weight_version)
        self.version = weight_version

    def get_weight_version(self) -> str | None:
        return getattr(self, "version", None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True


def test_local_client_drives_an_in_process_worker_end_to_end(tmp_path: Path) -> None:
    from wt_example.trainer import FileTrainerInitInfo

    model = ExampleNet(seed=8)
    names = [n for n, _ in model.named_parameters()]
    worker_model = RecordingModel(names)
    session = WorkerSession(
        WeightTransferEngineFactory.create_engine(
            WeightTransferConfig("example_file"), None, "cpu", worker_model
        )
    )
    llm = LLMShaped(session)
    client = LocalVLLMWeightSyncClient(llm)
    assert isinstance(client, VLLMWeightSyncClient)
    engine = WeightTransferTrainerFactory.trainer_init(
        FileTrainerInitInfo(str(tmp_path), rank=0), client=client, source=ModuleSource(model)
    )
    engine.send_weights()
    assert {n: digest(t) for n, t in worker_model.received.items()} == expected_digests(model)
    calls = [c for c, _ in llm.calls]
    assert calls == ["init", "start", "update", "update", "finish", "reset_prefix_cache"]
    assert llm.calls[-1] == ("reset_prefix_cache", True)  # kept requests' blocks too
    assert llm.calls[3][1] is not None and SEAL_FIELD in llm.calls[3][1]  # the trainer's seal
    assert llm.calls[0][1]["directory"] == str(tmp_path)
    assert llm.calls[2][1]["names"] == names
    assert not session.active

    with pytest.raises(WeightSyncRPCError) as err:
        client.finish_weight_update(weight_version="v1")  # no round is open
    assert err.value.method == "finish_weight_update"
    assert "RuntimeError: [wt:no_round] finish_weight_update called without a matching" in str(
        err.value
    )
    assert isinstance(err.value.__cause__, RuntimeError)


def test_the_trainers_client_aborts_an_open_round_and_a_strangers_is_refused(
    tmp_path: Path,
) -> None:
    """vLLM's `abort_weight_update` on a client: a trainer engine's client rolls the
    round back (signed with the trainer's key); a client no trainer uses is refused
    (a failed update ends the host's round anyway, as vLLM's worker does)."""
    from wt_example.trainer import FileTrainerInitInfo

    model = ExampleNet(seed=8)
    worker_model = RecordingModel([n for n, _ in model.named_parameters()])
    session = WorkerSession(
        WeightTransferEngineFactory.create_engine(
            WeightTransferConfig("example_file"), None, "cpu", worker_model
        )
    )
    llm = LLMShaped(session)
    client = LocalVLLMWeightSyncClient(llm)
    engine = WeightTransferTrainerFactory.trainer_init(
        FileTrainerInitInfo(str(tmp_path), rank=0), client=client, source=ModuleSource(model)
    )
    engine.send_weights(weight_version="v1")
    engine.begin()  # a round open on the worker
    stranger = LocalVLLMWeightSyncClient(llm)  # no trainer engine uses it: no key
    with pytest.raises(WeightSyncRPCError, match="wt_auth"):
        stranger.abort_weight_update("not mine")
    engine.abort("the host ended the round")
    engine.begin()
    assert session.active
    client.abort_weight_update("stopped by the caller")
    assert not session.active
    client.abort_weight_update("again")  # no round open: nothing happens
    engine.abort("the workers rolled back")
    worker_model.received.clear()
    engine.send_weights(weight_version="v2")
    assert {n: digest(t) for n, t in worker_model.received.items()} == expected_digests(model)


def test_a_fleet_aborts_the_open_round_on_every_replica(tmp_path: Path) -> None:
    from wt_example.trainer import FileTrainerInitInfo

    model = ExampleNet(seed=9)
    names = [n for n, _ in model.named_parameters()]
    models = [RecordingModel(names) for _ in range(2)]
    sessions = [
        WorkerSession(
            WeightTransferEngineFactory.create_engine(
                WeightTransferConfig("example_file"), None, "cpu", m
            )
        )
        for m in models
    ]
    fleet = FanOutClient([LocalVLLMWeightSyncClient(LLMShaped(s)) for s in sessions])
    engine = WeightTransferTrainerFactory.trainer_init(
        FileTrainerInitInfo(str(tmp_path), rank=0), client=fleet, source=ModuleSource(model)
    )
    engine.send_weights(weight_version="v1")
    engine.begin()
    assert all(s.active for s in sessions)
    fleet.abort_weight_update("stopped by the caller")
    assert not any(s.active for s in sessions)
    engine.abort("the workers rolled back")
    for m in models:
        m.received.clear()
    engine.send_weights(weight_version="v2")
    for m in models:
        assert {n: digest(t) for n, t in m.received.items()} == expected_digests(model)


def test_local_client_passes_weight_version_only_when_given() -> None:
    class Plain:
        def __init__(self) -> None:
            self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def finish_weight_update(self, *args: Any, **kwargs: Any) -> None:
            self.calls.append((args, kwargs))

    llm = Plain()
    client = LocalVLLMWeightSyncClient(llm, reset_prefix_cache=False)
    client.finish_weight_update()
    client.finish_weight_update("v2")
    assert llm.calls == [((), {}), ((), {"weight_version": "v2"})]
