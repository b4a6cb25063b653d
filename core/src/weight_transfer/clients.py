"""Clients: how a trainer reaches the inference side (HTTP, Ray actors, in-process LLM).

Each implements `VLLMWeightSyncClient`: it reaches every inference worker,
blocks until all are done, and raises `WeightSyncRPCError` (carrying the
server's message) when any of them fails.

Serving while syncing. From a round's first `update_weights` to its end the
model is half-loaded (inside vLLM its layers live on the meta device), so a
request that ran then would crash the engine. Every client therefore pauses
generation right after `start_weight_update` (which loads nothing), through
vLLM's own pause, and resumes it once the workers have closed the round:
after `finish_weight_update` (whether it succeeded or rolled back), after a
failed `update_weights` (the workers rolled back). The pause comes after the
start so that the workers know of the round that took it: a trainer that
dies between the two leaves an open round, which the workers roll back, and
resume generation, once they see the trainer gone. A start that fails pauses
nothing; one refused because a round is still open leaves generation as that
round left it (it may hold a half-loaded model: `RoundClient` aborts it before
starting its own). `pause` is the policy for requests in flight, vLLM's
`PauseMode`:

- `"keep"` (the default): in-flight requests are frozen and continue on the
  new weights after the resume (their KV recomputed once, on the new weights);
  nothing fails;
- `"wait"`: the round starts once in-flight requests have finished;
- `"abort"`: in-flight requests are aborted;
- `None`: no pause (the caller guarantees no request runs during a round).

A trainer that dies inside a round cannot resume what it paused: the engine
rolls the round back and resumes generation itself (`WeightTransferEngine`,
`weight_transfer.vllm.serving`); where it cannot reach its engine core, the
next round resumes it, or an operator's `resume_generation()`.

After a successful `finish_weight_update` each client resets the engine's
KV cache (`reset_prefix_cache=True`, the default), running requests' blocks
included (vLLM's `reset_running_requests`): every block was computed with the
old weights. A request sharing a cached prefix would reuse them, and a request
kept across the round (`"keep"`, or any request under `None`) is preempted and
recomputed, so its tokens after the round are a fresh engine's continuation on
the new weights. A reset the engine refuses raises `WeightSyncRPCError`.

`httpx`, `ray` and `vllm` are imported only when the matching client is created.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from weight_transfer.base import (
    UpdatePayload,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from weight_transfer.runtime.adapters import ADAPTER_FIELD, ADAPTER_SCHEME, Adapter
from weight_transfer.runtime.control import (
    ABORT_FIELD,
    REVERT_FIELD,
    ControlKey,
    Refusal,
    abort_round,
    control_round,
    refused,
)

__all__ = [
    "WeightSyncRPCError",
    "HTTPVLLMWeightSyncClient",
    "RayVLLMWeightSyncClient",
    "LocalVLLMWeightSyncClient",
    "PauseMode",
]

PauseMode = Literal["keep", "wait", "abort"]
IDEMPOTENT_ROUTES = frozenset(
    {"/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/weight_info", "/get_world_size"}
    | {"/v1/models"}
)
PAUSE_MODES = ("keep", "wait", "abort")
logger = logging.getLogger("weight_transfer")


def _unsigned(payload: dict[str, Any]) -> dict[str, Any]:
    return payload


class WeightSyncRPCError(RuntimeError):
    """An inference-side call failed; `method` names the call, `detail` the server's message."""

    def __init__(self, method: str, detail: str, *, status: int | None = None) -> None:
        where = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{method} failed on the inference side{where}: {detail}")
        self.method = method
        self.detail = detail
        self.status = status


class _PausingClient:
    """The round's pause / resume policy, shared by the built-in clients (see the module doc).

    A subclass supplies `_call(method, *args, **kwargs)` (raising
    `WeightSyncRPCError`), `_pause(mode)` and `_resume()`; the HTTP client also
    its own init, update, finish and prefix-cache reset.
    """

    pause: PauseMode | None
    reset_prefix_cache: bool
    # `finish_weight_update(..., resume=False)` keeps generation paused (see the fleet).
    resumes_on_request = True
    # The trainer's key, once a trainer engine uses this client: signs `abort_weight_update`.
    control: ControlKey | None = None

    def bind_control(self, control: ControlKey) -> None:
        """Sign this client's own controls with the trainer's key (`RoundClient` binds it)."""
        self.control = control

    def abort_weight_update(self, reason: str = "aborted by the caller") -> None:
        """vLLM's `abort_weight_update`: roll back the round open on the engine (every
        worker back on its previous weights and label; generation resumes). Sent as
        wt's in-band abort, signed with the trainer's key: an engine refuses it from a
        client that no trainer engine uses. No round open: nothing happens."""
        control = self.control
        abort_round(self.update_weights, reason, control.sign if control else _unsigned)

    def _set_policy(self, pause: PauseMode | None, reset_prefix_cache: bool) -> None:
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(
                f"pause must be one of {', '.join(PAUSE_MODES)} or None, got {pause!r}"
            )
        self.pause = pause
        self.reset_prefix_cache = reset_prefix_cache

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _pause(self, mode: PauseMode) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def pause_generation(self, mode: PauseMode = "keep") -> None:
        """Pause generation now (what a round does first)."""
        self._pause(mode)

    def resume_generation(self) -> None:
        """Resume generation, e.g. after a trainer died in a round that the workers
        have since closed (`update_weights` failed there, or a later round ran)."""
        self._resume()

    def _resume_after(self, error: BaseException) -> None:
        """Resume after the workers closed a round with `error`; a resume failure is logged.
        An engine whose model is incomplete (`Refusal.MODEL_INCOMPLETE`) stays paused."""
        if self.pause is None:
            return
        if refused(error, Refusal.MODEL_INCOMPLETE):
            logger.warning("generation stays paused until a complete round lands: %s", error)
            return
        try:
            self._resume()
        except Exception:
            logger.exception("resuming generation after a failed round (%s) failed", error)

    def _round_start(self, method: str) -> None:
        """Start the round, then pause (see the module doc). A failed pause leaves the
        round open on the workers: the caller aborts it (`RoundClient` does)."""
        self._call(method)
        if self.pause is not None:
            self._pause(self.pause)

    def start_weight_update(self) -> None:
        self._round_start("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._round_start("start_draft_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        try:
            self._call_update(update_info)
        except BaseException as error:
            aborting = isinstance(update_info, dict) and ABORT_FIELD in update_info
            if not (aborting and refused(error, Refusal.NO_ROUND)):
                self._resume_after(error)  # else it found no round: whatever ended it decided
            raise

    def finish_weight_update(
        self, weight_version: str | None = None, *, resume: bool = True
    ) -> None:
        """Finish the round; generation resumes after it, whether it succeeded or
        not, unless `resume=False` (a fleet resumes every replica once it knows
        what each serves: after all finished, or after it reverted them)."""
        try:
            self._call_finish(weight_version)
            if self.reset_prefix_cache:
                self._reset_prefix_cache()
        except BaseException as error:
            if resume:  # else the caller resumes, once it knows what the model holds
                self._resume_after(error)
            raise
        if resume and self.pause is not None:
            self._resume()

    def control_round(
        self,
        payload: dict[str, Any],
        accept: Sequence[Refusal] = (),
        *,
        paused: bool = False,
        sign: Callable[[dict[str, Any]], dict[str, Any]] = _unsigned,
    ) -> None:
        """A round that carries one in-band control and loads nothing (the
        fleet's revert and release, `weight_transfer.fleet`): start, the
        control, finish (`weight_transfer.runtime.control.control_round`). A refusal
        with a code in `accept` is an answer too (that refusal closed the round).

        Generation is paused for a revert only (it changes the weights; the
        prefix cache is reset after it) and resumed after it (`paused`: it is
        paused already, by a `finish_weight_update(resume=False)`); a release
        touches nothing. `sign` signs each control as it is sent (the fleet
        passes the trainer's key; see `weight_transfer.runtime.control`).
        """
        changes = REVERT_FIELD in payload

        def finish() -> None:
            self._call_finish(None)
            if changes and self.reset_prefix_cache:
                self._reset_prefix_cache()

        def start() -> None:
            self._call("start_weight_update")
            if changes and self.pause is not None and not paused:
                self._pause(self.pause)

        try:
            control_round(start, self._call_update, finish, payload, sign, accept)
        finally:
            if changes and self.pause is not None:
                self._resume()

    def weight_version(self) -> str:
        """The engine's weight version label."""
        return str(self._call("get_weight_version"))

    def set_weight_version(self, version: str) -> None:
        """Set the engine's weight version label (the fleet restores it on a revert)."""
        self._call("update_weight_version", version)

    # The engine's own methods, for clients whose `_call` reaches an `LLM` /
    # `AsyncLLM` object; init and update travel as vLLM's request objects.
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", WeightTransferInitRequest(init_info=init_info))

    def _call_update(self, update_info: UpdatePayload) -> None:
        self._call("update_weights", WeightTransferUpdateRequest(update_info=update_info))

    def _call_finish(self, weight_version: str | None) -> None:
        if weight_version is None:
            self._call("finish_weight_update")
        else:
            self._call("finish_weight_update", weight_version=weight_version)

    def _reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache", reset_running_requests=True)

    def shutdown_weight_transfer_engine(self) -> None:
        """Release every worker's trainer connection; inference goes on, and the
        trainer's next round re-admits the workers. Refused during a round."""
        self._call("collective_rpc", release_trainer)


def release_trainer(worker: Any) -> None:
    """In a vLLM worker (`collective_rpc`): vLLM 0.33's
    `shutdown_weight_transfer_engine`, or the same on 0.32's worker, which lacks it."""
    own = getattr(worker, "shutdown_weight_transfer_engine", None)
    if callable(own):
        own()
        return
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        return
    if getattr(engine, "round_open", False):
        raise RuntimeError("cannot release the trainer connection during a weight update")
    engine.shutdown()


class HTTPVLLMWeightSyncClient(_PausingClient):
    """A vLLM API server's RL routes over HTTP (`VLLM_SERVER_DEV_MODE=1` on the server).

    `timeout` bounds each request in seconds. `update_weights` blocks for the
    whole transfer, so it gets `update_timeout` (default: `timeout`).
    Generation is paused through `POST /pause?mode=...` and resumed through
    `POST /resume` (see the module doc for `pause`).

    Retries: after an error response or a failed request the pooled connections
    are dropped (servers close them after an error). A request that could not
    connect never reached the server and is retried once on a fresh connection,
    whatever the route. A request that failed after connecting may have been
    acted on, so only the idempotent routes (`IDEMPOTENT_ROUTES`: pause,
    resume, reset of the prefix cache, reads) are retried then; init, start,
    update and finish never are, and a timeout is never retried.
    """

    removal_pause: PauseMode = "wait"  # requests on an adapter being removed finish first

    def __init__(
        self,
        base_url: str,
        timeout: float = 300.0,
        *,
        update_timeout: float | None = None,
        pause: PauseMode | None = "keep",
        reset_prefix_cache: bool = True,
    ) -> None:
        import httpx

        self._set_policy(pause, reset_prefix_cache)
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.update_timeout = update_timeout if update_timeout is not None else timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self._swap = threading.Lock()  # guards `_http` and `_users`
        self._users: dict[Any, int] = {}  # requests in flight per client

    def _request(
        self, method: str, route: str, body: Any = None, *, timeout: float | None = None
    ) -> Any:
        """One request; see the class docstring for when it is retried."""
        import httpx

        path = route.split("?")[0]
        name = path.lstrip("/")
        attempts = 2
        for attempt in range(attempts):
            with self._using() as http:
                try:
                    response = http.request(
                        method,
                        route,
                        json=body,
                        timeout=timeout if timeout is not None else self.timeout,
                    )
                except httpx.HTTPError as e:
                    self._reconnect(http)
                    retry = isinstance(e, httpx.ConnectError) or (
                        path in IDEMPOTENT_ROUTES
                        and isinstance(e, httpx.TransportError)
                        and not isinstance(e, httpx.TimeoutException)
                    )
                    if retry and attempt + 1 < attempts:
                        continue
                    raise WeightSyncRPCError(name, f"{type(e).__name__}: {e}") from e
                if not response.is_success:
                    self._reconnect(http)  # servers close the connection after an error
                    detail = _error_detail(response)
                    raise WeightSyncRPCError(name, detail, status=response.status_code)
                if not response.content:
                    return None
                try:
                    return response.json()
                except ValueError:  # vLLM's LoRA routes answer in plain text
                    return response.text
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _using(self) -> Iterator[Any]:
        """The current `httpx.Client`, counted as in use until the block ends; one that
        `_reconnect` replaced is closed when its last user is done, never under a
        request of another thread."""
        with self._swap:
            http = self._http
            self._users[http] = self._users.get(http, 0) + 1
        try:
            yield http
        finally:
            with self._swap:
                self._users[http] -= 1
                retired = self._users[http] == 0 and http is not self._http
                if self._users[http] == 0:
                    del self._users[http]
            if retired:
                http.close()

    def _reconnect(self, failed: Any) -> None:
        """Replace `failed` (the client a request of this thread failed on, whose
        connection the server may have closed) by a fresh one, unless another call
        did already; `_using` closes `failed` once nobody uses it."""
        import httpx

        with self._swap:
            if self._http is failed:
                self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._request("POST", f"/{method}")

    def _pause(self, mode: PauseMode) -> None:
        self._request("POST", f"/pause?mode={mode}")

    def _resume(self) -> None:
        self._request("POST", "/resume")

    def _reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache?reset_running_requests=true")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def _call_update(self, update_info: UpdatePayload) -> None:
        self._request(
            "POST", "/update_weights", {"update_info": update_info}, timeout=self.update_timeout
        )

    def _call_finish(self, weight_version: str | None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._request("POST", "/finish_weight_update", body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "/shutdown_weight_transfer_engine")

    def check_adapter(self, adapter: Adapter) -> None:
        """Refuse, before its round, an adapter named like a model the server serves
        itself (`/v1/models`: a card without a parent): requests on the name would
        get that model."""
        for card in self._request("GET", "/v1/models")["data"]:
            if card["id"] == adapter.name and card.get("parent") is None:
                raise ValueError(
                    f"{ADAPTER_FIELD}: field 'name' ({adapter.name!r}) is a name of the "
                    f"served base model on {self.base_url}: requests on it would get the base model"
                )

    def adapter_landed(self, adapter: Adapter) -> None:
        """Make the server's name for a synced LoRA adapter point at it: register the
        name through `/v1/load_lora_adapter` with the path `wt-adapter:<name>` (the
        workers serve it from memory), so the OpenAI `model` field names it, unless
        `/v1/models` lists it with that path already; a name listed with another
        path (a caller registered it first, or re-registered it) is pointed back
        (`load_inplace`). For a removal, unregister the name and every other name
        listed with its path. The server needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`
        for these routes."""
        path = ADAPTER_SCHEME + adapter.name
        cards = self._request("GET", "/v1/models")["data"]
        roots = {card["id"]: card.get("root") for card in cards}
        if adapter.remove:
            for name, root in roots.items():
                if name == adapter.name or root == path:
                    self._unload_adapter(name)
            return
        if adapter.name in roots and roots[adapter.name] == path:
            return
        body: dict[str, Any] = {"lora_name": adapter.name, "lora_path": path}
        if adapter.name in roots:
            logger.warning(
                "adapter name %r pointed at %r on %s; pointing it back at the synced adapter",
                adapter.name, roots[adapter.name], self.base_url,
            )  # fmt: skip
            body["load_inplace"] = True
        self._request("POST", "/v1/load_lora_adapter", body)

    def _unload_adapter(self, name: str) -> None:
        try:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        except WeightSyncRPCError as error:
            if error.status != 404:  # 404: the server did not know the name (any more)
                raise

    def is_paused(self) -> bool:
        return bool(self._request("GET", "/is_paused")["is_paused"])

    def weight_version(self) -> str:
        return str(self._request("GET", "/weight_info")["weight_version"])

    def set_weight_version(self, version: str) -> None:
        self._request("POST", "/update_weight_version", {"new_version": version})

    def close(self) -> None:
        self._http.close()


def _error_detail(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if key in body:
                value = body[key]
                if isinstance(value, dict) and isinstance(value.get("message"), str):
                    return value["message"]  # {"error": {"message": ..., "code": ...}}
                return value if isinstance(value, str) else str(value)
    return str(body)


class RayVLLMWeightSyncClient(_PausingClient):
    """One or more Ray actor handles (`handle`: one, or a list, as vLLM's client
    takes them) wrapping an `LLM`/`AsyncLLM` (or anything with the four
    methods). Each call fans out to every handle and blocks on all, at most
    `timeout` seconds.

    Init and update travel as request objects (`request.init_info`,
    `request.update_info`), which `AsyncLLM` requires and `LLM` accepts.
    Generation is paused per actor through `pause_generation(mode=...)` /
    `resume_generation()` (`AsyncLLM`) or `sleep(level=0, mode=...)` /
    `wake_up(tags=["scheduling"])` (`LLM`); an actor with neither is not paused.
    """

    def __init__(
        self,
        handle: Any | Sequence[Any],
        timeout: float = 300.0,
        *,
        pause: PauseMode | None = "keep",
        reset_prefix_cache: bool = True,
    ) -> None:
        import ray

        self._set_policy(pause, reset_prefix_cache)
        self._ray = ray
        self.handles = list(handle) if isinstance(handle, (list, tuple)) else [handle]
        if not self.handles:
            raise ValueError("RayVLLMWeightSyncClient needs at least one actor handle")
        self.timeout = timeout

    def _get(self, method: str, refs: list[Any]) -> list[Any]:
        try:
            return list(self._ray.get(refs, timeout=self.timeout))
        except self._ray.exceptions.GetTimeoutError as e:
            raise WeightSyncRPCError(method, f"no answer within {self.timeout:g}s") from e
        except self._ray.exceptions.RayError as e:
            cause = getattr(e, "cause", None) or e
            raise WeightSyncRPCError(method, f"{type(cause).__name__}: {cause}") from e

    def _call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        return self._get(method, refs)

    def _each(self, what: str, options: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Call, on every handle, the first method of `options` it has (or none)."""
        refs = []
        for handle in self.handles:
            for name, kwargs in options:
                method = getattr(handle, name, None)
                if method is not None:
                    refs.append(method.remote(**kwargs))
                    break
        self._get(what, refs)

    def weight_version(self) -> str:
        """The first handle's label (a fleet keeps one client per replica)."""
        return str(self._call("get_weight_version")[0])

    def _pause(self, mode: PauseMode) -> None:
        self._each(
            "pause_generation",
            [("pause_generation", {"mode": mode}), ("sleep", {"level": 0, "mode": mode})],
        )

    def _resume(self) -> None:
        self._each(
            "resume_generation",
            [("resume_generation", {}), ("wake_up", {"tags": ["scheduling"]})],
        )


class LocalVLLMWeightSyncClient(_PausingClient):
    """An in-process `vllm.LLM` (or anything exposing its four RL methods).

    Init and update travel as request objects. Generation is paused through
    `sleep(level=0, mode=...)` and resumed through `wake_up(tags=["scheduling"])`
    when the object has them (an `LLM` does); other objects are not paused.
    """

    def __init__(
        self,
        llm: Any,
        *,
        pause: PauseMode | None = "keep",
        reset_prefix_cache: bool = True,
    ) -> None:
        self.llm = llm
        self._set_policy(pause, reset_prefix_cache)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.llm, method)(*args, **kwargs)
        except Exception as e:
            raise WeightSyncRPCError(method, f"{type(e).__name__}: {e}") from e

    def _pause(self, mode: PauseMode) -> None:
        if callable(getattr(self.llm, "sleep", None)):
            self._call("sleep", level=0, mode=mode)

    def _resume(self) -> None:
        if callable(getattr(self.llm, "wake_up", None)):
            self._call("wake_up", tags=["scheduling"])
