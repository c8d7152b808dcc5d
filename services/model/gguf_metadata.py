"""Typed access to a GGUF file's key/value metadata (`gguf.GGUFReader` underneath).

Every accessor names the key it fails on; a file that is not (or no longer, e.g. truncated) a
GGUF raises `InvalidGGUFFile` naming the file and what the reader hit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderField

from services.model.errors import (
    CheckpointMismatch,
    InvalidModelConfig,
    MissingCheckpointFile,
    ModelError,
)


class InvalidGGUFFile(ModelError):
    """The file is not a readable GGUF (bad magic, unsupported version, truncated)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a readable GGUF file: {reason}")


class MissingGGUFKey(InvalidModelConfig):
    """A metadata key the runtime needs is absent from the GGUF file."""

    def __init__(self, key: str, why: str = "required") -> None:
        super().__init__(key, f"missing from the GGUF metadata ({why})")


class TruncatedGGUFFile(InvalidGGUFFile):
    """The file ends before the header or a tensor's data does; `tensor` names the first
    tensor whose bytes are cut (None: the header itself is cut, after `last_key`)."""

    def __init__(self, path: Path, needed: int, size: int, tensor: str | None,
                 last_key: str | None) -> None:
        self.tensor = tensor
        self.last_key = last_key
        where = (f"tensor {tensor!r}" if tensor
                 else f"the header (cut after key {last_key!r})" if last_key else "the header")
        super().__init__(path, f"truncated: {where} needs {needed} bytes, the file has {size}")


class _ShortRead(Exception):
    def __init__(self, needed: int, tensor: str | None = None, last_key: str | None = None) -> None:
        self.needed = needed
        self.tensor = tensor
        self.last_key = last_key


class _ArrayReader(GGUFReader):
    """GGUFReader over a plain-ndarray view of its file map, which says where a cut file ends.

    Parsing the header slices the map once per vocabulary string (~100K times for a 49K-token
    BPE); np.memmap's per-slice `__array_finalize__` made that 2.7x slower. The view keeps the
    map (and the file) alive. The base reader turns a short slice into a numpy shape error; here
    every read is bounds-checked first, and every tensor's byte range before any is sliced."""

    @property  # type: ignore[override]  # a plain ndarray where the base declares np.memmap
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            fields = getattr(self, "fields", {})  # set once the version is read
            raise _ShortRead(end, last_key=next(reversed(fields), None))
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            tensor = str(bytes(name), encoding="utf-8")
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except ValueError as error:
                type_id = int(raw_type[0])
                raise CheckpointMismatch(tensor, f"unknown ggml type id {type_id}") from error
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * size // block
            if end > len(self.data):
                raise _ShortRead(end, tensor)
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    """A memory-mapped reader of `path`: TruncatedGGUFFile when the file is cut short,
    InvalidGGUFFile when its bytes do not parse (bad magic, unknown version or value type)."""
    if not path.is_file():
        raise MissingCheckpointFile(path, "GGUF file not found")
    try:
        return _ArrayReader(path, "r")
    except _ShortRead as cut:
        raise TruncatedGGUFFile(
            path, cut.needed, path.stat().st_size, cut.tensor, cut.last_key
        ) from None
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as error:
        raise InvalidGGUFFile(path, f"{type(error).__name__}: {error}") from error


class GGUFMetadata:
    """Typed access to the key/value section; every accessor names the key it fails on."""

    def __init__(self, reader: GGUFReader) -> None:
        self.reader = reader

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def value(self, key: str, default: Any = None, required: bool = True) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if required and default is None:
                raise MissingGGUFKey(key)
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, IndexError) as error:
            raise InvalidModelConfig(key, f"cannot be decoded: {error}") from error

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.value(key, default)
        if isinstance(value, list):  # per-layer arrays (e.g. head_count): uniform only
            if not value or len(set(value)) != 1:
                raise InvalidModelConfig(key, f"per-layer values {value[:8]} are not supported")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidModelConfig(key, f"expected an integer, got {value!r}")
        return int(value)

    def number(self, key: str, default: float | None = None) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise InvalidModelConfig(key, f"expected a number, got {value!r}")
        return float(value)

    def string(self, key: str, default: str | None = None) -> str:
        value = self.value(key, default)
        if not isinstance(value, str):
            raise InvalidModelConfig(key, f"expected a string, got {type(value).__name__}")
        return value

    def optional_integer(self, key: str) -> int | None:
        return self.integer(key) if self.has(key) else None
