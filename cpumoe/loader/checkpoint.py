"""A local Hugging Face checkpoint directory: config.json plus safetensors weights, read lazily.

    path/config.json
    path/model.safetensors                                   (one file)
    path/model.safetensors.index.json + model-0000k-of-n.safetensors   (sharded: weight_map names each tensor's file)

Shards are opened with `safetensors.safe_open` (memory-mapped) the first time one of their tensors is asked for;
`shape`/`dtype` read only the header. Nothing is fetched from the hub: the path must already exist.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_REQUIRED = object()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, a config key or a tensor."""


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist (only local paths are read; "
                                  "download the model first)")
        config_file = self.path / CONFIG
        if not config_file.is_file():
            raise CheckpointError(f"{config_file} not found: a checkpoint directory needs a {CONFIG}")
        self.config: dict = json.loads(config_file.read_text())
        self._file_of: dict[str, str] = self._find_weights()  # tensor name -> shard file name
        self._open: dict[str, object] = {}  # shard file name -> safe_open handle
        self._headers: dict[str, dict] = {}  # shard file name -> its parsed header (read)

    def _find_weights(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            for shard in sorted(set(weight_map.values())):
                if not (self.path / shard).is_file():
                    raise CheckpointError(f"shard {shard} named in {index} is missing from {self.path}")
            return weight_map
        single = self.path / SINGLE
        if single.is_file():
            with safe_open(single, framework="pt") as f:
                return {name: SINGLE for name in f.keys()}
        raise CheckpointError(f"no weights in {self.path}: expected {SINGLE} or {INDEX}")

    @property
    def weights_bytes(self) -> int:
        """Size on disk of the weight files (all shards)."""
        return sum((self.path / shard).stat().st_size for shard in set(self._file_of.values()))

    # --- config ---------------------------------------------------------------------------------------------
    def config_get(self, *keys: str, default=_REQUIRED):
        """The first of `keys` present in config.json (aliases, e.g. "num_experts", "num_local_experts")."""
        for key in keys:
            if key in self.config:
                return self.config[key]
        if default is _REQUIRED:
            raise CheckpointError(f"{self.path / CONFIG} has no {' / '.join(repr(k) for k in keys)}")
        return default

    @property
    def model_type(self) -> str:
        return self.config_get("model_type")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype config.json says the weights are in ("dtype" in transformers 5, "torch_dtype" before)."""
        name = self.config_get("dtype", "torch_dtype", default=None)
        if name is None:
            return None
        if name not in _DTYPES:
            raise CheckpointError(f"{self.path / CONFIG}: unsupported dtype {name!r}")
        return _DTYPES[name]

    # --- tensors --------------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        shard = self._file_of[name]
        if shard not in self._open:
            self._open[shard] = safe_open(self.path / shard, framework="pt")
        return self._open[shard]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped from its shard (copy it before writing to it)."""
        return self._handle(name).get_tensor(name)

    def read(self, name: str, out: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        """The tensor, read with plain file reads into memory of its own (`out`, a contiguous tensor of its shape
        and dtype, if given). Unlike `get`, nothing stays memory-mapped: once the caller drops the tensor its
        memory is free, so a loader that packs weights does not hold the checkpoint's pages as well.
        index: read only tensor[index], one slice of dim 0 (one expert of a fused [E, ...] tensor)."""
        shard = self._file_of.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        entry, data_start = self._header(shard)[name], self._header(shard)["__data_start__"]
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise CheckpointError(f"tensor {name!r} {list(shape)} has no slice {index} of dim 0")
            row_bytes = (end - begin) // shape[0]
            begin, shape = begin + index * row_bytes, shape[1:]
            end = begin + row_bytes
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"read({name!r}): out is {out.dtype} {list(out.shape)}, the tensor {dtype} {list(shape)}")
        if end > begin:
            view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
            with open(self.path / shard, "rb", buffering=0) as f:
                f.seek(data_start + begin)
                done = 0
                while done < end - begin:
                    n = f.readinto(view[done:])
                    if not n:
                        raise CheckpointError(f"{self.path / shard} ends inside tensor {name!r}")
                    done += n
        return out

    def _header(self, shard: str) -> dict:
        """A shard's safetensors header (name -> dtype, shape, data_offsets), with where its data starts."""
        if shard not in self._headers:
            with open(self.path / shard, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            header["__data_start__"] = 8 + size
            self._headers[shard] = header
        return self._headers[shard]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._handle(name).get_slice(name).get_dtype()]

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, model_type={self.config.get('model_type')!r}, tensors={len(self._file_of)})"
