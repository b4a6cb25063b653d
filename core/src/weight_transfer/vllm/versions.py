"""Which weights made each token: weight versions in vLLM's OpenAI responses.

vLLM's engine core stamps every step's outputs with its weight version label
(the label a round's finish sets: wt hands the workers the trainer's label,
`patches`), and vLLM's output processor turns the stamps into spans on a
finished `CompletionOutput` (`weight_versions`: `WeightVersionSpan(version,
start, end)` over output-token indexes). So `LLM` and `AsyncLLM` outputs say
which versions made their tokens already; vLLM's OpenAI routes drop it.

`install()` wraps the OpenAI completion and chat handlers so that every choice
of a response, and the streamed chunk that finishes a choice, carries:

- `weight_versions`: the labels its tokens were generated under, in order
  (one label when no round landed during the request);
- `weight_version_spans` (when the request sets `"weight_version_spans":
  true`): `[{"version", "start", "end"}, ...]`, output-token index ranges.

A request that sets vLLM 0.33's own opt-in, `"return_weight_versions": true`,
gets 0.33's shape instead, on 0.32 as on 0.33: `weight_versions` is the list
of `{"version", "start", "end"}` objects (and nothing else is added), so a
client written for vLLM 0.33 reads what it expects.

OpenAI clients ignore fields they do not know. Under a round with `pause="keep"`
a request frozen mid-generation continues on the new weights: its spans name
both versions, the second from the first token sampled after the round.

Version-pinned to vLLM 0.32's handlers, which 0.33.0 keeps:
`OpenAIServingCompletion.completion_stream_generator` /
`request_output_to_completion_response` and `OpenAIServingChat.
chat_completion_stream_generator` / `chat_completion_full_generator`.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["install", "SPANS_FIELD", "VERSIONS_FIELD", "REQUEST_SPANS_FIELD", "VLLM_REQUEST_FIELD"]

VERSIONS_FIELD = "weight_versions"
SPANS_FIELD = "weight_version_spans"
REQUEST_SPANS_FIELD = "weight_version_spans"  # the request's opt-in
VLLM_REQUEST_FIELD = "return_weight_versions"  # vLLM 0.33's opt-in: its shape
_MARK = "__wt_versions__"


def install() -> None:
    """Wrap vLLM's OpenAI completion and chat handlers (once per process)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    if getattr(OpenAIServingCompletion.completion_stream_generator, _MARK, False):
        return
    _wrap(OpenAIServingCompletion, "completion_stream_generator", _streamed(prompts=True))
    _wrap(OpenAIServingChat, "chat_completion_stream_generator", _streamed(prompts=False))
    _wrap(OpenAIServingChat, "chat_completion_full_generator", _chat_full)
    _wrap(OpenAIServingCompletion, "request_output_to_completion_response", _completion_full)


Shape = str  # "labels", "spans" (labels and spans) or "vllm" (vLLM 0.33's)


def fields(spans: Any, shape: Shape) -> dict[str, Any]:
    """The response fields of one choice whose output has vLLM's `spans`."""
    objects = [{"version": s.version, "start": s.start, "end": s.end} for s in spans]
    if shape == "vllm":
        return {VERSIONS_FIELD: objects}
    out: dict[str, Any] = {VERSIONS_FIELD: [span.version for span in spans]}
    if shape == "spans":
        out[SPANS_FIELD] = objects
    return out


def _wrap(cls: type, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(cls, name)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _shape(request: Any) -> Shape:
    if getattr(request, VLLM_REQUEST_FIELD, None) is True:
        return "vllm"
    return "spans" if getattr(request, REQUEST_SPANS_FIELD, None) is True else "labels"


class _Recorder:
    """Passes a handler's results through, keeping each finished choice's spans by
    choice index (`prompts`: items are `(prompt_index, output)` and a choice's
    index counts `n` choices per prompt, as vLLM's completion handler does)."""

    def __init__(self, results: AsyncIterator[Any], prompts: bool, n: int) -> None:
        self.results = results
        self.prompts = prompts
        self.n = n
        self.spans: dict[int, Any] = {}

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for item in self.results:
            prompt, result = item if self.prompts else (0, item)
            for output in result.outputs:
                if output.weight_versions is not None:
                    self.spans[output.index + prompt * self.n] = output.weight_versions
            yield item


def _recording(original: Any, self: Any, args: Any, kwargs: Any, prompts: bool) -> Any:
    """`(bound arguments with the handler's result generator recorded, recorder)`."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    request = bound.arguments["request"]
    recorder = _Recorder(bound.arguments["result_generator"], prompts, request.n or 1)
    bound.arguments["result_generator"] = recorder.__aiter__()
    return bound, recorder


def _streamed(prompts: bool) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        async def stream(self: Any, *args: Any, **kwargs: Any) -> Any:
            bound, recorder = _recording(original, self, args, kwargs, prompts)
            shape = _shape(bound.arguments["request"])
            async for event in original(*bound.args, **bound.kwargs):
                yield _stamped(event, recorder.spans, shape) if recorder.spans else event

        return stream

    return make


def _stamped(event: str, spans: dict[int, Any], shape: Shape) -> str:
    """A streamed `data: {...}` event whose choices that finish carry their versions
    (and leave `spans`)."""
    if not event.startswith("data: {"):
        return event
    chunk = json.loads(event[len("data: ") :])
    stamped = False
    for choice in chunk.get("choices") or ():
        index = choice.get("index")
        if choice.get("finish_reason") is not None and index in spans:
            choice.update(fields(spans.pop(index), shape))
            stamped = True
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n" if stamped else event


def _chat_full(original: Any) -> Any:
    async def full(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound, recorder = _recording(original, self, args, kwargs, prompts=False)
        response = await original(*bound.args, **bound.kwargs)
        shape = _shape(bound.arguments["request"])
        for choice in getattr(response, "choices", None) or ():
            if choice.index in recorder.spans:
                for name, value in fields(recorder.spans[choice.index], shape).items():
                    setattr(choice, name, value)
        return response

    return full


def _completion_full(original: Any) -> Any:
    def full(self: Any, final_res_batch: list[Any], request: Any, *args: Any, **kw: Any) -> Any:
        response = original(self, final_res_batch, request, *args, **kw)
        outputs = [output for result in final_res_batch for output in result.outputs]
        shape = _shape(request)
        for choice, output in zip(response.choices, outputs, strict=False):
            if output.weight_versions is not None:
                for name, value in fields(output.weight_versions, shape).items():
                    setattr(choice, name, value)
        return response

    return full
