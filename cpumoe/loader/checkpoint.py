"""A local Hugging Face checkpoint directory: config.json plus safetensors weights, read lazily.

    path/config.json
    path/model.safetensors                                   (one file)
    path/model.safetensors.index.json + model-0000k-of-n.safetensors   (sharded: weight_map names each tensor's file)

Shards are opened with `safetensors.safe_open` (memory-mapped) the first time one of their tensors is asked for;
`shape`/`dtype` read only the header. Nothing is fetched from the hub: the path must already exist.
"""
from __future__ import annotations

import json
import os
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
    """A checkpoint directory is missing a file, a config key or a tensor, or holds one that cannot be read."""


# config.json keys that, when present, must be integers (not strings, floats or booleans) or numbers: a wrong type
# would otherwise surface as a TypeError deep inside model construction.
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size", "num_experts",
             "num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
             "shared_expert_intermediate_size", "decoder_sparse_step", "first_k_dense_replace", "kv_lora_rank",
             "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
             "sliding_window", "num_nextn_predict_layers")
_NUMBER_KEYS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")


def read_json(file: Path) -> object:
    """A JSON file's value; bad JSON or bad UTF-8 is a CheckpointError naming the file."""
    try:
        return json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


class CheckpointConfig:
    """A checkpoint's config.json: what a model is (model_type, shapes, routing) before any tensor is read. A
    Checkpoint is one with its weights; make-model and the presets read a config without weights."""

    def __init__(self, path: str | Path, config: dict | None = None):
        """config.json of the directory `path`; or `config`, a dict of its values (`path` then only names it)."""
        self.path = Path(path).expanduser()
        if config is None:
            if not self.path.is_dir():
                raise CheckpointError(f"checkpoint directory {self.path} does not exist (only local paths are read; "
                                      "download the model first)")
            config_file = self.path / CONFIG
            if not config_file.is_file():
                raise CheckpointError(f"{config_file} not found: a checkpoint directory needs a {CONFIG}")
            config = read_json(config_file)
            if not isinstance(config, dict):
                raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
        self.config: dict = config
        self._check_config_types()

    def _check_config_types(self) -> None:
        for key in _INT_KEYS:
            value = self.config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise CheckpointError(f"{self.path / CONFIG}: {key} must be an integer, got {value!r}")
        for key in _NUMBER_KEYS:
            value = self.config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise CheckpointError(f"{self.path / CONFIG}: {key} must be a number, got {value!r}")

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


class Checkpoint(CheckpointConfig):
    """A local Hugging Face checkpoint directory: its config.json and its safetensors weights (one file, or shards
    with an index)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._open: dict[str, object] = {}  # shard file name -> safe_open handle
        self._headers: dict[str, dict] = {}  # shard file name -> its parsed header (read)
        self._file_of: dict[str, str] = self._find_weights()  # tensor name -> shard file name

    def _find_weights(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            data = read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            if not all(isinstance(shard, str) for shard in weight_map.values()):
                raise CheckpointError(f"{index}: every weight_map value must be a shard file name")
            root = self.path.resolve()
            for shard in sorted(set(weight_map.values())):
                # a shard is a file of this directory: never a path that leads out of it
                if Path(shard).name != shard or shard in (".", ".."):
                    raise CheckpointError(f"{index} names shard {shard!r}: shards must be files of {self.path}")
                if (self.path / shard).resolve().parent != root:
                    raise CheckpointError(f"{index} names shard {shard!r}, which leads outside {self.path}")
                if not (self.path / shard).is_file():
                    raise CheckpointError(f"shard {shard} named in {index} is missing from {self.path}")
            return weight_map
        single = self.path / SINGLE
        if single.is_file():
            return dict.fromkeys(sorted(name for name in self._header(SINGLE) if not name.startswith("__")), SINGLE)
        raise CheckpointError(f"no weights in {self.path}: expected {SINGLE} or {INDEX}")

    @property
    def weights_bytes(self) -> int:
        """Size on disk of the weight files (all shards)."""
        return sum((self.path / shard).stat().st_size for shard in set(self._file_of.values()))

    # --- tensors --------------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        shard = self._file_of[name]
        self._entry(shard, name)  # the header is whole and holds the tensor
        if shard not in self._open:
            try:
                self._open[shard] = safe_open(self.path / shard, framework="pt")
            except Exception as e:  # safetensors' own error type: a file it cannot map
                raise CheckpointError(f"{self.path / shard}: not a readable safetensors file ({e})") from None
        return self._open[shard]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped from its shard (copy it before writing to it)."""
        return self._handle(name).get_tensor(name)

    def read(self, name: str, out: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        """The tensor, read with plain file reads into memory of its own (`out`, a contiguous tensor of its shape
        and dtype, if given). Unlike `get`, nothing stays memory-mapped: once the caller drops the tensor its
        memory is free, so a loader that packs weights does not hold the checkpoint's pages as well; and the tensor's
        file pages leave the page cache once read (_drop_cached).
        index: read only tensor[index], one slice of dim 0 (one expert of a fused [E, ...] tensor)."""
        shard = self._file_of.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        entry, data_start = self._entry(shard, name), self._header(shard)["__data_start__"]
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
                _drop_cached(f, data_start + begin, end - begin)
        return out

    def _header(self, shard: str) -> dict:
        """A shard's safetensors header (name -> dtype, shape, data_offsets), with where its data starts. A header
        that is cut short, is not JSON, or describes data past the end of the file is a CheckpointError."""
        if shard not in self._headers:
            file = self.path / shard
            file_size = file.stat().st_size
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if file_size < 8 or size > file_size - 8:
                    raise CheckpointError(f"{file}: not a safetensors file (its header does not fit the file; "
                                          "truncated or corrupt)")
                try:
                    header = json.loads(f.read(size))
                except (ValueError, UnicodeDecodeError) as e:
                    raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
            if not isinstance(header, dict):
                raise CheckpointError(f"{file}: corrupt safetensors header")
            data = file_size - 8 - size
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                try:
                    begin, end = entry["data_offsets"]
                    known = entry["dtype"] in _DTYPES and isinstance(entry["shape"], list)
                except (KeyError, TypeError, ValueError):
                    known = False
                if not known:
                    raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry")
                if not 0 <= begin <= end <= data:
                    raise CheckpointError(f"{file} ends inside tensor {name!r} (truncated: {data} data bytes, the "
                                          f"tensor ends at {end})")
            header["__data_start__"] = 8 + size
            self._headers[shard] = header
        return self._headers[shard]

    def _entry(self, shard: str, name: str) -> dict:
        header = self._header(shard)
        if name not in header or name.startswith("__"):
            raise CheckpointError(f"{self.path / INDEX} places tensor {name!r} in {shard}, which does not hold it")
        return header[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._handle(name).get_slice(name).get_dtype()]

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, model_type={self.config.get('model_type')!r}, tensors={len(self._file_of)})"


class CheckpointView(Checkpoint):
    """Some tensors of a checkpoint under other names, with a config.json of their own: the language model inside a
    multimodal checkpoint, read as a text-only one. `names` maps each name as read to its name on disk; reads go to
    the whole checkpoint's files, and a missing tensor is named as it is on disk."""

    def __init__(self, whole: Checkpoint, config: dict, names: dict[str, str]):
        CheckpointConfig.__init__(self, whole.path, config)
        self.whole, self._disk_name = whole, names

    @property
    def weights_bytes(self) -> int:
        return self.whole.weights_bytes

    def keys(self) -> list[str]:
        return list(self._disk_name)

    def __contains__(self, name: str) -> bool:
        return name in self._disk_name

    def get(self, name: str) -> torch.Tensor:
        return self.whole.get(self._name(name))

    def read(self, name: str, out: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        return self.whole.read(self._name(name), out=out, index=index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.whole.shape(self._name(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.whole.dtype(self._name(name))

    def _name(self, name: str) -> str:
        if name not in self._disk_name:
            raise CheckpointError(f"tensor {name!r} of the {self.model_type} model not found in checkpoint {self.path}")
        return self._disk_name[name]

    def __repr__(self) -> str:
        return f"CheckpointView({str(self.path)!r}, {self.model_type}, tensors={len(self._disk_name)})"


def _drop_cached(f, offset: int, length: int) -> None:
    """Tells the kernel a tensor's file pages will not be read again: a loader packs what it reads into memory of
    its own, and a page cache full of checkpoint files leaves the kernel no free 2 MB blocks for the packed weights'
    huge pages (loading seven checkpoints in one process, the last ones got 41-46% of their weights on them; with
    each tensor's pages dropped once read, 100%). The disk reads them again at a later load."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), offset, length, os.POSIX_FADV_DONTNEED)
