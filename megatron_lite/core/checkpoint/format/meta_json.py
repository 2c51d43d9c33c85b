"""The non-tensor part of a checkpoint as tagged JSON (``meta.json``): nothing is pickled, nothing unpickled.

Lightning's checkpoint dict holds, besides the model and optimizer tensors (which go to DCP), the loops'
progress, LR schedulers, callbacks' state, hyperparameters (the module's config dataclasses), the
datamodule's state (consumed samples) and our layout record. JSON has no tuples, non-finite floats,
tensors or dataclasses, so those are written as one-key objects whose key is a tag::

    {"__tuple__": [1, 2]}                      a tuple
    {"__float__": "inf"}                       inf, -inf or nan (JSON numbers cannot be non-finite)
    {"__tensor__": {"dtype": "float32", "shape": [2], "data": [0.5, {"__float__": "inf"}]}}
                                               a small tensor (at most MAX_INLINE_ELEMENTS), on the CPU
    {"__dtype__": "bfloat16"}                  a torch.dtype
    {"__path__": "/runs/ckpt"}                 a pathlib path (read back as pathlib.Path)
    {"__dataclass__": {"class": "megatron_lite.core.models.config.GPTConfig", "fields": {...}}}
                                               an allow-listed config dataclass
    {"__dict__": [[key, value], ...]}          a dict whose keys are not all strings, or that would
                                               read as a tag

Everything else (plain dicts, lists, strings, numbers, booleans, null) is itself. A value of any other
type is refused when the checkpoint is written, with the key path and the fix -- never dropped.

Reading imports nothing and calls nothing named by the file: dtypes come from a fixed table, and a
dataclass is rebuilt only if its qualified name is one of the classes the caller allows (the live
module's own config classes); otherwise it is refused, or (``unknown_classes="dict"``, for inspection)
returned as a plain dict with its class name under ``"__class__"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Iterable, Literal, Mapping, Optional

import torch

from megatron_lite.core.checkpoint.errors import CheckpointMetaError
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.optim.config import OptimizerConfig

FORMAT = "megatron-lite-meta/1"
MAX_INLINE_ELEMENTS = 4096
"""Largest tensor written inline into meta.json; bigger ones belong in the model/optimizer state (DCP)."""

_TAGS = frozenset({"__tuple__", "__float__", "__tensor__", "__dtype__", "__path__", "__dataclass__", "__dict__"})
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def class_name(cls: type) -> str:
    """The qualified name a dataclass is recorded under: ``module.QualName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def default_config_classes() -> list[type]:
    """Config dataclasses every megatron-lite checkpoint may hold: the model's and the optimizer's."""
    return [GPTConfig, OptimizerConfig]


def dataclass_types(values: Iterable[Any]) -> list[type]:
    """The dataclass types among ``values`` and inside them (fields, lists, dicts), in a fixed order: the classes
    a checkpoint of objects holding these values (a module's configs and hyperparameters) may rebuild. Taken from
    objects the user built, never from names in a checkpoint."""
    found: set[type] = set()
    pending = list(values)
    while pending:
        value = pending.pop()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in found:
                found.add(type(value))
                pending += [getattr(value, f.name) for f in dataclasses.fields(value)]
        elif isinstance(value, dict):
            pending += list(value.values())
        elif isinstance(value, (list, tuple)):
            pending += list(value)
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def _allowed_by_name(allowed: Iterable[type]) -> dict[str, type]:
    classes = {class_name(c): c for c in [*default_config_classes(), *allowed]}
    for name, cls in classes.items():
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"allowed checkpoint classes must be dataclass types, got {name}")
    return classes


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


# --- writing ------------------------------------------------------------------------------
def encode(value: Any, allowed: Iterable[type] = ()) -> Any:
    """``value`` as JSON-ready data in the tagged encoding; raises CheckpointMetaError naming the key
    path of anything it cannot hold."""
    return _Encoder(_allowed_by_name(allowed)).encode(value, "checkpoint")


class _Encoder:
    def __init__(self, allowed: dict[str, type]):
        self.allowed = allowed

    def refuse(self, where: str, value: Any, why: str = "") -> CheckpointMetaError:
        names = ", ".join(sorted(n.rsplit(".", 1)[-1] for n in self.allowed))
        return CheckpointMetaError(
            f"{where} is a {_type_name(value)}{why}, which a megatron-lite checkpoint's metadata (meta.json) "
            f"cannot hold: it is written as JSON and never pickled. It may hold None, bool, int, float, str, lists, "
            f"tuples, dicts, small tensors, torch dtypes, paths and the config dataclasses ({names}). Store this "
            f"value as one of those (e.g. a dict of numbers and strings), or leave it out of the hyperparameters "
            f"(save_hyperparameters(ignore=[...])) or of the callback's state_dict."
        )

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
        if type(value) is list:
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) is tuple:
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):  # dict subclasses (OrderedDict, Lightning's AttributeDict) are written as dicts
            if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
                return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            return {
                "__dict__": [
                    [self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()
                ]
            }
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, pathlib.PurePath):
            return {"__path__": str(value)}
        if torch.is_tensor(value):
            return self.tensor(value, where)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            name = class_name(type(value))
            if self.allowed.get(name) is not type(value):
                raise self.refuse(where, value, " (a dataclass that is not one of the module's config classes)")
            return {
                "__dataclass__": {
                    "class": name,
                    "fields": {
                        f.name: self.encode(getattr(value, f.name), f"{where}.{f.name}")
                        for f in dataclasses.fields(value)
                        if f.init
                    },
                }
            }
        raise self.refuse(where, value)

    def tensor(self, value: torch.Tensor, where: str) -> dict:
        if value.layout != torch.strided or value.is_complex() or value.is_quantized or type(value) is not torch.Tensor:
            raise self.refuse(where, value, f" ({value.dtype}, {value.layout})")
        if value.numel() > MAX_INLINE_ELEMENTS:
            raise CheckpointMetaError(
                f"{where} is a tensor of {value.numel()} elements; the checkpoint's metadata (meta.json) holds "
                f"tensors of at most {MAX_INLINE_ELEMENTS}. Keep large tensors in the module (a parameter or a "
                f"persistent buffer), where they are written as DCP shards."
            )
        flat = value.detach().to("cpu").reshape(-1).tolist()
        return {
            "__tensor__": {
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "data": [self.encode(v, where) for v in flat],
            }
        }


def dumps(meta: Any, allowed: Iterable[type] = ()) -> bytes:
    """The bytes of a ``meta.json`` holding ``meta``."""
    document = {"format": FORMAT, "meta": encode(meta, allowed)}
    return json.dumps(document, indent=1, allow_nan=False).encode("utf-8")


# --- reading ------------------------------------------------------------------------------
UnknownClasses = Literal["error", "dict"]


def decode(data: Any, allowed: Optional[Iterable[type]] = (), unknown_classes: UnknownClasses = "error") -> Any:
    """The inverse of :func:`encode`. Dataclasses are rebuilt only from ``allowed`` (and the default
    config classes); with ``unknown_classes="dict"`` the others -- all of them if ``allowed`` is None --
    come back as ``{"__class__": name, **fields}`` without calling anything."""
    by_name = _allowed_by_name(allowed) if allowed is not None else {}
    return _Decoder(by_name, unknown_classes).decode(data, "meta")


class _Decoder:
    def __init__(self, allowed: Mapping[str, type], unknown: UnknownClasses):
        self.allowed = allowed
        self.unknown = unknown

    def decode(self, data: Any, where: str) -> Any:
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if isinstance(data, list):
            return [self.decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
        if not isinstance(data, dict):
            raise CheckpointMetaError(f"{where}: unexpected JSON value {data!r}")
        if len(data) == 1 and next(iter(data)) in _TAGS:
            ((tag, body),) = data.items()
            return getattr(self, "tag_" + tag.strip("_"))(body, where)
        return {k: self.decode(v, f"{where}.{k}") for k, v in data.items()}

    def tag_tuple(self, body: Any, where: str) -> tuple:
        return tuple(self.decode(self.expect(body, list, where), where))

    def tag_float(self, body: Any, where: str) -> float:
        if body not in _NONFINITE:
            raise CheckpointMetaError(f"{where}: {{'__float__': {body!r}}} is not inf, -inf or nan")
        return _NONFINITE[body]

    def tag_dtype(self, body: Any, where: str) -> torch.dtype:
        if body not in _DTYPES:
            raise CheckpointMetaError(f"{where}: unknown torch dtype {body!r}")
        return _DTYPES[body]

    def tag_path(self, body: Any, where: str) -> pathlib.Path:
        return pathlib.Path(self.expect(body, str, where))

    def tag_dict(self, body: Any, where: str) -> dict:
        pairs = self.expect(body, list, where)
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise CheckpointMetaError(f"{where}: '__dict__' must hold [key, value] pairs")
        out = {}
        for key, value in pairs:
            key = self.decode(key, where)
            try:
                out[key] = self.decode(value, f"{where}[{key!r}]")
            except TypeError:  # an unhashable key (a list)
                raise CheckpointMetaError(f"{where}: dict key {key!r} is not hashable") from None
        return out

    def tag_tensor(self, body: Any, where: str) -> torch.Tensor:
        body = self.expect(body, dict, where)
        dtype = self.tag_dtype(body.get("dtype"), where)
        shape = self.expect(body.get("shape"), list, where)
        data = [self.decode(v, where) for v in self.expect(body.get("data"), list, where)]
        if (
            not all(isinstance(s, int) and s >= 0 for s in shape)
            or math.prod(shape) != len(data)
            or len(data) > MAX_INLINE_ELEMENTS
        ):
            raise CheckpointMetaError(f"{where}: tensor data of {len(data)} values does not fit shape {shape}")
        odd = [v for v in data if not isinstance(v, (bool, int, float))]
        if odd:
            raise CheckpointMetaError(f"{where}: tensor data holds {odd[0]!r:.80}, not a number")
        try:
            return torch.tensor(data, dtype=dtype).reshape(shape)
        except (RuntimeError, TypeError, ValueError, OverflowError) as error:  # e.g. 1e5 as int8, a quantized dtype
            raise CheckpointMetaError(f"{where}: tensor of {dtype} cannot hold its data ({error})") from None

    def tag_dataclass(self, body: Any, where: str) -> Any:
        body = self.expect(body, dict, where)
        name = self.expect(body.get("class"), str, where)
        fields = {k: self.decode(v, f"{where}.{k}") for k, v in self.expect(body.get("fields"), dict, where).items()}
        cls = self.allowed.get(name)
        if cls is None:
            if self.unknown == "dict":
                return {"__class__": name, **fields}
            raise CheckpointMetaError(
                f"{where} is a {name}, which is not one of the config classes this load allows "
                f"({', '.join(sorted(self.allowed))}); megatron-lite never imports a class named by a checkpoint. "
                f"Load it into a module whose config is a {name.rsplit('.', 1)[-1]}, or inspect it with "
                f"`megatron-lite checkpoint inspect`."
            )
        try:
            return cls(**fields)
        except (TypeError, ValueError) as error:
            raise CheckpointMetaError(f"{where}: the saved {name} cannot be rebuilt by this version: {error}") from None

    @staticmethod
    def expect(value: Any, kind: type, where: str) -> Any:
        if not isinstance(value, kind):
            raise CheckpointMetaError(f"{where}: expected a JSON {kind.__name__}, got {value!r:.80}")
        return value


def loads(
    raw: bytes,
    allowed: Optional[Iterable[type]] = (),
    unknown_classes: UnknownClasses = "error",
    source: str = "meta.json",
) -> Any:
    """The metadata held by the bytes of a ``meta.json``."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointMetaError(f"{source} is not valid JSON ({error}); the file is damaged") from None
    except RecursionError:
        raise _too_deep(source) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or "meta" not in document:
        raise CheckpointMetaError(
            f"{source} is not a megatron-lite checkpoint metadata file (format "
            f"{document.get('format') if isinstance(document, dict) else None!r}, "
            f"expected {FORMAT!r})"
        )
    try:
        return decode(document["meta"], allowed, unknown_classes)
    except CheckpointMetaError as error:
        raise CheckpointMetaError(f"{source}: {error}") from None
    except RecursionError:
        raise _too_deep(source) from None


def _too_deep(source: str) -> CheckpointMetaError:
    return CheckpointMetaError(
        f"{source} is malformed: it nests deeper than a checkpoint's metadata does (crafted or "
        f"damaged); it cannot be loaded"
    )
