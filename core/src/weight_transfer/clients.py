"""Clients: how a trainer reaches the inference side (HTTP, Ray actors, in-process LLM).

Each implements `VLLMWeightSyncClient`: it reaches every inference worker,
blocks until all are done, and raises `WeightSyncRPCError` (carrying the
server's message) when any of them fails.

After a successful `finish_weight_update` each client resets the engine's
prefix cache (`reset_prefix_cache=True`, the default): cached KV blocks were
computed with the old weights, and a request sharing a prefix would reuse them.

`httpx`, `ray` and `vllm` are imported only when the matching client is created.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weight_transfer.base import UpdatePayload

__all__ = [
    "WeightSyncRPCError",
    "HTTPVLLMWeightSyncClient",
    "RayVLLMWeightSyncClient",
    "LocalVLLMWeightSyncClient",
]


class WeightSyncRPCError(RuntimeError):
    """An inference-side call failed; `method` names the call, `detail` the server's message."""

    def __init__(self, method: str, detail: str, *, status: int | None = None) -> None:
        where = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{method} failed on the inference side{where}: {detail}")
        self.method = method
        self.detail = detail
        self.status = status


class HTTPVLLMWeightSyncClient:
    """A vLLM API server's RL routes over HTTP (`VLLM_SERVER_DEV_MODE=1` on the server).

    `timeout` bounds each request in seconds. `update_weights` blocks for the
    whole transfer, so it gets `update_timeout` (default: `timeout`).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 300.0,
        *,
        update_timeout: float | None = None,
        reset_prefix_cache: bool = True,
    ) -> None:
        import httpx

        self.reset_prefix_cache = reset_prefix_cache
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.update_timeout = update_timeout if update_timeout is not None else timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def _request(
        self, method: str, route: str, body: Any = None, *, timeout: float | None = None
    ) -> Any:
        import httpx

        try:
            response = self._http.request(
                method,
                route,
                json=body,
                timeout=timeout if timeout is not None else self.timeout,
            )
        except httpx.HTTPError as e:
            raise WeightSyncRPCError(route.lstrip("/"), f"{type(e).__name__}: {e}") from e
        if not response.is_success:
            raise WeightSyncRPCError(
                route.lstrip("/"), _error_detail(response), status=response.status_code
            )
        return response.json() if response.content else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._request("POST", "/start_draft_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        self._request(
            "POST", "/update_weights", {"update_info": update_info}, timeout=self.update_timeout
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._request("POST", "/finish_weight_update", body)
        if self.reset_prefix_cache:
            self._request("POST", "/reset_prefix_cache")

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "/shutdown_weight_transfer_engine")

    def weight_version(self) -> str:
        return str(self._request("GET", "/weight_info")["weight_version"])

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


class RayVLLMWeightSyncClient:
    """One or more Ray actor handles wrapping an `LLM`/`AsyncLLM` (or anything with
    the four methods). Each call fans out to every handle and blocks on all,
    at most `timeout` seconds."""

    def __init__(
        self,
        handles: Any | Sequence[Any],
        timeout: float = 300.0,
        *,
        reset_prefix_cache: bool = True,
    ) -> None:
        import ray

        self.reset_prefix_cache = reset_prefix_cache
        self._ray = ray
        self.handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        if not self.handles:
            raise ValueError("RayVLLMWeightSyncClient needs at least one actor handle")
        self.timeout = timeout

    def _fan_out(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        try:
            return list(self._ray.get(refs, timeout=self.timeout))
        except self._ray.exceptions.GetTimeoutError as e:
            raise WeightSyncRPCError(method, f"no answer within {self.timeout:g}s") from e
        except self._ray.exceptions.RayError as e:
            cause = getattr(e, "cause", None) or e
            raise WeightSyncRPCError(method, f"{type(cause).__name__}: {cause}") from e

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._fan_out("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._fan_out("start_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        self._fan_out("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._fan_out("finish_weight_update", weight_version=weight_version)
        if self.reset_prefix_cache:
            self._fan_out("reset_prefix_cache")


class LocalVLLMWeightSyncClient:
    """An in-process `vllm.LLM` (or anything exposing its four RL methods)."""

    def __init__(self, llm: Any, *, reset_prefix_cache: bool = True) -> None:
        self.llm = llm
        self.reset_prefix_cache = reset_prefix_cache

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        try:
            getattr(self.llm, method)(*args, **kwargs)
        except Exception as e:
            raise WeightSyncRPCError(method, f"{type(e).__name__}: {e}") from e

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            self._call("finish_weight_update")
        else:
            self._call("finish_weight_update", weight_version=weight_version)
        if self.reset_prefix_cache:
            self._call("reset_prefix_cache")
