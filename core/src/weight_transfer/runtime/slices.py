"""Slice-exact loading: learn once what a model keeps of each tensor, then move only that.

A model's `load_weights` narrows, views, transposes and chunks each tensor it
is handed, then `copy_`s the result into (a view of) one of its parameters.
`record_slices` runs that code once with `RecordingTensor`s: zero-storage
stand-ins that log every operation applied to them as an op chain and, at the
final `copy_`, record a `Scatter`: which tensor, which chain, which parameter,
where in it (offset, shape, stride, relative to the parameter's storage).
Nothing is written: the recording tensor's `copy_` only logs.

Afterwards, every round a producer holding the full tensor replays the chain
(`apply_chain`) and ships the resulting slice; the receiver writes it at the
recorded place (`write_scatters`, one batched copy per call): `load_weights`
does not run again.

The ops a chain may hold are an explicit allowlist (`ALLOWED_OPS`), shared by
recorder and replayer: pure views and shape operations, never anything that
changes dtype or device or computes (`to`, arithmetic, `.item()`, boolean or
tensor indexing). A loader that does anything else raises `UnsupportedOp`
naming the weight, its chain so far and the operation, at recording time,
before a byte moves. Chains are tuples of plain values (slices and dtypes are
encoded), so they hash on every supported Python and cross any wire.

Invariants replay relies on, enforced when recording: a copy's source and
destination have the same number of elements (no broadcasting), the
destination is a view of one of the declared parameters, and the slice's
dtype is the source's dtype after its chain (a `view(dtype)` reinterprets).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer.payload import dtype_from_name, dtype_name
from weight_transfer.source import ParamMeta

__all__ = [
    "ALLOWED_OPS",
    "Op",
    "Chain",
    "FetchKey",
    "Scatter",
    "UnsupportedOp",
    "RecordingTensor",
    "SliceRecord",
    "record_slices",
    "apply_chain",
    "write_scatters",
    "storage_id",
    "describe_chain",
]

# Pure view / shape operations, by torch.Tensor method name. Multi-output ops
# are recorded as the op followed by ("__getitem__", (i,)).
ALLOWED_OPS = frozenset(
    {
        "narrow",
        "view",
        "reshape",
        "flatten",
        "permute",
        "transpose",
        "t",
        "unsqueeze",
        "squeeze",
        "__getitem__",
        "contiguous",
        "chunk",
        "unbind",
        "split",
        "view_as",
    }
)
_MULTI_OUTPUT = frozenset({"chunk", "unbind", "split"})

# Metadata reads answered from the stand-in's shape and dtype; they record nothing.
_METADATA = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "__len__",
        "get_device",
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "is_meta",
        "is_cpu",
        "layout",
        "requires_grad",
        "is_sparse",
        "is_quantized",
        "__repr__",
        "__format__",
        "__hash__",
    }
)

Op = tuple[str, tuple[Any, ...], tuple[tuple[str, Any], ...]]
Chain = tuple[Op, ...]
FetchKey = tuple[str, Chain]


class UnsupportedOp(NotImplementedError):
    """A loader did something to a tensor that a slice cannot reproduce."""


def describe_chain(chain: Chain) -> str:
    if not chain:
        return "the whole tensor"
    return ".".join(f"{name}{tuple(_decode(a) for a in args)}" for name, args, _ in chain)


# -- encoding op arguments ------------------------------------------------------
def _encode(value: Any) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, slice):
        return ("__slice__", _encode(value.start), _encode(value.stop), _encode(value.step))
    if value is Ellipsis:
        return ("__ellipsis__",)
    if isinstance(value, torch.dtype):
        return ("__dtype__", dtype_name(value))
    if isinstance(value, torch.Size | tuple | list):
        return tuple(_encode(v) for v in value)
    raise UnsupportedOp(f"argument {value!r} ({type(value).__name__})")


def _decode(value: Any) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, tuple | list):
        if value and value[0] == "__slice__":
            _, start, stop, step = value
            return slice(_decode(start), _decode(stop), _decode(step))
        if value and value[0] == "__ellipsis__":
            return Ellipsis
        if value and value[0] == "__dtype__":
            return dtype_from_name(value[1], field="op chain dtype")
        return tuple(_decode(v) for v in value)
    raise ValueError(f"an op chain holds {value!r} ({type(value).__name__}), not an op argument")


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):  # a property of Tensor
        prop = getattr(getattr(func, "__self__", None), "__name__", "?")
        return prop if name == "__get__" else f"{prop} assignment"
    return str(name)


def apply_chain(tensor: torch.Tensor, chain: Sequence[Op]) -> torch.Tensor:
    """Replay `chain` on `tensor`; `ValueError` for an op outside `ALLOWED_OPS`.

    A chain arriving from elsewhere is checked op by op: only allowlisted
    Tensor methods with plain arguments run.
    """
    result: Any = tensor
    for op in chain:
        name, args, kwargs = op
        if name not in ALLOWED_OPS:
            raise ValueError(f"op {name!r} is not an allowed slice op ({sorted(ALLOWED_OPS)})")
        decoded = tuple(_decode(a) for a in args)
        kw = {str(k): _decode(v) for k, v in kwargs}
        if isinstance(result, tuple):  # the pick after a multi-output op
            if name != "__getitem__" or len(decoded) != 1 or kw:
                raise ValueError(f"op {name!r} applied to the outputs of a multi-output op")
            result = result[decoded[0]]
            continue
        result = getattr(result, name)(*decoded, **kw)
        if name in _MULTI_OUTPUT:
            result = tuple(result)
    if not isinstance(result, torch.Tensor):
        raise ValueError("an op chain ended on the outputs of a multi-output op")
    return result


def storage_id(tensor: torch.Tensor) -> int:
    """An identity of `tensor`'s storage, shared by all its views (meta tensors too)."""
    return int(tensor.untyped_storage()._cdata)


# -- recording ------------------------------------------------------------------
@dataclass(frozen=True)
class Scatter:
    """One recorded copy: slice `key` of a tensor lands in `module`'s `param`.

    `offset`, `shape`, `stride` locate the destination view, with `offset`
    relative to the parameter's own storage offset; `src_shape` and
    `src_dtype` describe the slice (after its chain) as the copy saw it.
    """

    key: FetchKey
    module: str
    param: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    src_shape: tuple[int, ...]
    src_dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.src_shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.src_dtype.itemsize


@dataclass
class SliceRecord:
    """What one recording pass found: the scatters of every name that was loaded."""

    scatters: dict[str, list[Scatter]] = field(default_factory=dict)
    # (module, param) -> elements the scatters cover (uncovered ones are the loader's padding)
    covered: dict[tuple[str, str], int] = field(default_factory=dict)


class _Sink:
    def __init__(self, targets: Mapping[int, tuple[str, str, torch.Tensor]]) -> None:
        self.targets = targets
        self.record = SliceRecord()

    def accept_copy(self, dest: torch.Tensor, src: RecordingTensor) -> None:
        where = f"{src._wt_name!r} ({describe_chain(src._wt_chain)})"
        if isinstance(dest, RecordingTensor):
            raise UnsupportedOp(f"{where}: copy into another incoming tensor")
        if dest.numel() != src.numel():
            raise UnsupportedOp(
                f"{where}: a broadcasting copy ({list(src.shape)} into {list(dest.shape)}) "
                "cannot be replayed slice-exact"
            )
        target = self.targets.get(storage_id(dest))
        if target is None:
            raise UnsupportedOp(
                f"{where}: copied into a tensor that is not one of the model's parameters"
            )
        module, param_name, param = target
        scatter = Scatter(
            key=(src._wt_name, src._wt_chain),
            module=module,
            param=param_name,
            offset=int(dest.storage_offset()) - int(param.storage_offset()),
            shape=tuple(dest.shape),
            stride=tuple(dest.stride()),
            src_shape=tuple(src.shape),
            src_dtype=src.dtype,
        )
        self.record.scatters.setdefault(src._wt_name, []).append(scatter)
        place = (module, param_name)
        self.record.covered[place] = self.record.covered.get(place, 0) + dest.numel()


class RecordingTensor(torch.Tensor):
    """A zero-storage stand-in for an incoming tensor; see the module docstring.

    It is a meta tensor with the incoming tensor's shape and dtype. Metadata
    reads answer directly; allowlisted ops return a new stand-in whose chain
    is one op longer; a `copy_` from it is recorded by the sink; anything else
    raises `UnsupportedOp`.
    """

    _wt_name: str
    _wt_chain: Chain
    _wt_sink: _Sink

    @staticmethod
    def make(meta: torch.Tensor, name: str, chain: Chain, sink: _Sink) -> RecordingTensor:
        tensor = torch.Tensor._make_subclass(RecordingTensor, meta)
        tensor._wt_name, tensor._wt_chain, tensor._wt_sink = name, chain, sink
        return tensor

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = _op_name(func)
        selves = [a for a in args if isinstance(a, RecordingTensor)]
        this = selves[0] if selves else next(
            v for v in kwargs.values() if isinstance(v, RecordingTensor)
        )  # fmt: skip
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], RecordingTensor):
            this._wt_sink.accept_copy(args[0], args[1])
            return args[0]
        where = f"{this._wt_name!r} ({describe_chain(this._wt_chain)})"
        if name not in ALLOWED_OPS or args[0] is not this:
            raise UnsupportedOp(f"{where}: {name} is not a slice op (allowed: views and reshapes)")
        if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
            raise UnsupportedOp(f"{where}: {name} with a tensor argument (tensor or mask indexing)")
        try:
            op: Op = (
                name,
                tuple(_encode(a) for a in args[1:]),
                tuple(sorted((k, _encode(v)) for k, v in kwargs.items())),
            )
        except UnsupportedOp as error:
            raise UnsupportedOp(f"{where}: {name} with {error}") from None
        with torch._C.DisableTorchFunctionSubclass():
            plain = torch.empty_strided(this.shape, this.stride(), dtype=this.dtype, device="meta")
            out = getattr(plain, name)(*args[1:], **kwargs)
        chain = (*this._wt_chain, op)
        if name in _MULTI_OUTPUT:
            return tuple(
                cls.make(child, this._wt_name, (*chain, ("__getitem__", (i,), ())), this._wt_sink)
                for i, child in enumerate(out)
            )
        return cls.make(out, this._wt_name, chain, this._wt_sink)


LoadFn = Callable[[list[tuple[str, torch.Tensor]]], Any]


def record_slices(
    batches: Sequence[Sequence[ParamMeta]],
    load: LoadFn,
    targets: Mapping[int, tuple[str, str, torch.Tensor]],
) -> SliceRecord:
    """Run `load` once per batch over recording tensors; return what it kept.

    `targets` maps `storage_id` of each loadable parameter (real or meta) to
    `(module name, parameter name, parameter)`. A name the loader skipped gets
    no entry in `SliceRecord.scatters`. Raises `UnsupportedOp` naming the
    weight and operation when the loader does something a slice cannot
    reproduce.
    """
    sink = _Sink(targets)
    with torch.no_grad():
        for batch in batches:
            fakes: list[tuple[str, torch.Tensor]] = [
                (m.name, RecordingTensor.make(_meta(m), m.name, (), sink)) for m in batch
            ]
            try:
                load(fakes)
            except UnsupportedOp:
                raise
            except Exception as error:  # torch refused a recording tensor somewhere
                names = ", ".join(repr(m.name) for m in batch[:3])
                raise UnsupportedOp(
                    f"the model's loading code failed on recording tensors for {names}"
                    f"{' ...' if len(batch) > 3 else ''}: {type(error).__name__}: {error}"
                ) from error
    return sink.record


def _meta(meta: ParamMeta) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=meta.dtype, device="meta")


def write_scatters(writes: Sequence[tuple[torch.Tensor, Scatter, torch.Tensor]]) -> None:
    """Write each slice `src` (laid out contiguously, `scatter.src_dtype`) where it was
    recorded in `param`: one batched copy for all of `writes` `(param, scatter, src)`."""
    dests = []
    srcs = []
    for param, scatter, src in writes:
        data = param.data
        dests.append(
            data.as_strided(scatter.shape, scatter.stride, data.storage_offset() + scatter.offset)
        )
        srcs.append(src.view(scatter.src_shape))
    if dests:
        with torch.no_grad():
            torch._foreach_copy_(dests, srcs)


# What a dry run hands the recorder: the model's load function and its
# parameters by storage (`record_slices`'s `targets`).
DryRun = tuple[LoadFn, dict[int, tuple[str, str, torch.Tensor]]]


def parameter_targets(
    modules: Iterable[tuple[str, torch.nn.Module]],
) -> dict[int, tuple[str, str, torch.Tensor]]:
    """`(module name, parameter name, parameter)` by storage, for a dry run."""
    targets: dict[int, tuple[str, str, torch.Tensor]] = {}
    for module_name, module in modules:
        for param_name, param in module.named_parameters(recurse=False):
            targets[storage_id(param)] = (module_name, param_name, param)
    return targets
