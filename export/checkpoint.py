"""Load a DeepSeek-V3 checkpoint (Hugging Face layout) into the target and MTP modules.

Reads config.json, checks every safetensors header against the modules' state dicts before
allocating anything, then streams the tensors one at a time (shard by shard) into modules built
without weight initialisation, so the model is held once. FP8 e4m3 weights are dequantized with
their `weight_scale_inv` block scales as in DeepSeek-V3's `inference/kernel.py` `weight_dequant`.
The MTP layers' `embed_tokens` / `shared_head.head` duplicates are checked against the target's
`model.embed_tokens` / `lm_head` rather than loaded twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm
from transformers.initialization import TORCH_INIT_FUNCTIONS

from triton_mtp.export.config import ModelConfig
from triton_mtp.export.errors import CheckpointError
from triton_mtp.export.model import DeepseekV3MTP, DeepseekV3Target, group_weights
from triton_mtp.export.moe import MOE_KINDS

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_SHARED_DUPLICATES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_SHOWN = 3  # names listed in a missing / unexpected tensors error


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    file: Path
    dtype: str  # safetensors dtype name: F32, BF16, F8_E4M3, ...
    shape: tuple[int, ...]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch.float32 / bfloat16 / float16, or one of their names ("bf16", "float16", "torch.float32", ...)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype: unsupported {dtype!r} (expected float32, bfloat16 or float16)")


def load_checkpoint(
    checkpoint_dir: str | Path,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_slots: int = 4,
    max_seq_len: int | None = None,
    progress: bool = True,
    moe: str = "dense",
) -> tuple[ModelConfig, DeepseekV3Target, DeepseekV3MTP | None]:
    """Build the target (and MTP, when the checkpoint has MTP layers) and load their weights.

    `moe` "grouped" (the GPU build) stacks each MoE's experts after loading (export/moe.py) and fuses each
    attention's two input projections into one (`MLAttention.fuse_input_projections`); "dense" keeps them.

    `max_seq_len` defaults to the config's `max_position_embeddings`. A checkpoint without MTP
    tensors (or with num_nextn_predict_layers 0) returns mtp=None and a config with
    num_nextn_predict_layers 0. Raises CheckpointError with a one-line message naming the file,
    tensor or key at fault.
    """
    if moe not in MOE_KINDS:
        raise ValueError(f"moe: must be one of {', '.join(MOE_KINDS)}, got {moe!r}")
    root = Path(checkpoint_dir)
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_checkpoint(root)
    block = _block_size(root / "config.json")
    files, claims = shard_files(root)
    tensors = read_headers(files)
    check_index(claims, tensors)
    config = _mtp_presence(config, tensors)
    max_seq_len = config.max_position_embeddings if max_seq_len is None else max_seq_len

    with torch.device("meta"):
        shapes = _expected_shapes(*_build(config, max_slots, max_seq_len))
    duplicates = _check_names(root, config, tensors, shapes)
    _check_shapes(tensors, shapes, block)

    with _default_dtype(dtype), torch.device(device), _no_init_weights():
        target, mtp = _build(config, max_slots, max_seq_len)
    params = target.state_dict(keep_vars=True)
    if mtp is not None:
        params.update(mtp.state_dict(keep_vars=True))
    _stream(root, params, duplicates, tensors, block, progress)
    for module in (target, mtp):
        if module is not None:
            module.eval().requires_grad_(False)
    if moe == "grouped":
        group_weights(target, mtp)
    return config, target, mtp


@contextlib.contextmanager
def _no_init_weights() -> Iterator[None]:
    """torch.nn.init's functions do nothing while the modules are built: the checkpoint overwrites every
    parameter. transformers' `no_init_weights` does this too, but importing its PreTrainedModel pulls in
    scipy and the rest of modeling_utils, seconds at every model load in a Triton backend stub."""
    originals = {name: getattr(torch.nn.init, name) for name in TORCH_INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    for name in originals:
        setattr(torch.nn.init, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


def _stream(
    root: Path,
    params: dict[str, torch.Tensor],
    duplicates: dict[str, str],
    tensors: dict[str, TensorInfo],
    block: tuple[int, int],
    progress: bool,
) -> None:
    """Copy each tensor into its parameter, file by file; then check the MTP duplicates of shared ones."""
    with contextlib.ExitStack() as stack, torch.no_grad():
        shards = _OpenFiles(stack)
        bar = stack.enter_context(tqdm(total=len(params), desc=f"loading {root.name}", unit="tensor",
                                       disable=not progress))
        for name in sorted(params, key=lambda n: (str(tensors[n].file), n)):
            params[name].copy_(shards.read(name, tensors, block))
            bar.update()
        for name, shared in duplicates.items():
            if not torch.equal(shards.read(name, tensors, block).to(params[shared]), params[shared]):
                raise CheckpointError(
                    f"{tensors[name].file}: tensor {name!r} differs from {shared!r} (MTP layers share it)"
                )


def shard_files(root: Path) -> tuple[list[Path], dict[str, Path]]:
    """The safetensors files of a checkpoint, and the file the index names for each tensor.

    With `model.safetensors.index.json` the files are the shards it names (the mapping is checked
    against the headers by `check_index`); otherwise `model.safetensors` and an empty mapping.
    """
    index = root / INDEX_FILE
    if not index.is_file():
        if (root / SINGLE_FILE).is_file():
            return [root / SINGLE_FILE], {}
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE} found")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: invalid JSON ({e})") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{index}: missing key 'weight_map'") from None
    claims = {name: root / shard for name, shard in weight_map.items()}
    for name, path in claims.items():
        if not path.is_file():
            raise CheckpointError(f"{index}: shard {path.name!r} (holding tensor {name!r}) not found")
    return list(dict.fromkeys(claims.values())), claims


def check_index(claims: dict[str, Path], tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the index lists must be in the shard it names."""
    for name, path in claims.items():
        if name not in tensors or tensors[name].file != path:
            raise CheckpointError(f"{path.parent / INDEX_FILE}: tensor {name!r} is not in its shard {path.name!r}")


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Name -> file, dtype and shape for every tensor, from the headers only."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    meta = f.get_slice(name)
                    if name in tensors:
                        raise CheckpointError(f"{path}: tensor {name!r} is also in {tensors[name].file}")
                    tensors[name] = TensorInfo(path, meta.get_dtype(), tuple(meta.get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0]})") from None
    return tensors


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn weight[R, C] times its per-block scale_inv[ceil(R/b0), ceil(C/b1)] -> float32 [R, C]."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows]  # [R, ceil(C/b1)]
    scale = scale.repeat_interleave(block[1], 1)[:, :cols]  # [R, C]
    return weight.float() * scale


def _block_size(config_path: Path) -> tuple[int, int]:
    """The FP8 weight_block_size of config.json's quantization_config (DeepSeek's 128 x 128 when absent)."""
    quant = json.loads(config_path.read_text()).get("quantization_config")
    if quant is None:
        return DEFAULT_BLOCK
    method, fmt = (quant.get("quant_method"), quant.get("fmt", "e4m3")) if isinstance(quant, dict) else (quant, None)
    if (method, fmt) != ("fp8", "e4m3"):
        raise CheckpointError(
            f"{config_path}: unsupported quantization_config "
            f"(quant_method {method!r}, fmt {fmt!r}; expected 'fp8', 'e4m3')"
        )
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{config_path}: key 'quantization_config.weight_block_size' must be two positive integers, got {block!r}"
        )
    return block[0], block[1]


def _mtp_presence(config: ModelConfig, tensors: dict[str, TensorInfo]) -> ModelConfig:
    """The config, with num_nextn_predict_layers 0 when no MTP tensor is in the checkpoint."""
    n = config.num_hidden_layers
    prefixes = tuple(f"model.layers.{n + i}." for i in range(config.num_nextn_predict_layers))
    if prefixes and any(name.startswith(prefixes) for name in tensors):
        return config
    log.warning("no MTP layers: plain decoding only")
    return dataclasses.replace(config, num_nextn_predict_layers=0)


def _build(config: ModelConfig, max_slots: int, max_seq_len: int) -> tuple[DeepseekV3Target, DeepseekV3MTP | None]:
    target = DeepseekV3Target(config, max_slots, max_seq_len)
    mtp = DeepseekV3MTP(config, target, max_slots, max_seq_len) if config.num_nextn_predict_layers else None
    return target, mtp


def _expected_shapes(target: DeepseekV3Target, mtp: DeepseekV3MTP | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor the modules load."""
    shapes = {name: tuple(t.shape) for name, t in target.state_dict().items()}
    if mtp is not None:
        shapes.update({name: tuple(t.shape) for name, t in mtp.state_dict().items()})
    return shapes


def _check_names(
    root: Path, config: ModelConfig, tensors: dict[str, TensorInfo], shapes: dict[str, tuple[int, ...]]
) -> dict[str, str]:
    """Fail on missing or unexpected tensors; return the MTP duplicates of shared tensors -> the shared name."""
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"{root}: missing tensors {_listing(missing)}")
    n = config.num_hidden_layers
    shared_copies = {f"model.layers.{n + i}.{suffix}": shared
                     for i in range(config.num_nextn_predict_layers) for suffix, shared in _SHARED_DUPLICATES.items()}
    duplicates, unexpected = {}, []
    for name in sorted(set(tensors) - set(shapes)):
        weight = name.removesuffix(SCALE_SUFFIX)
        if name.endswith(SCALE_SUFFIX) and weight in shapes and tensors[weight].dtype == "F8_E4M3":
            continue
        if name in shared_copies:
            duplicates[name] = shared_copies[name]
        else:
            unexpected.append(name)
    if unexpected:
        raise CheckpointError(f"{tensors[unexpected[0]].file}: unexpected tensors {_listing(unexpected)}")
    return duplicates


def _check_shapes(tensors: dict[str, TensorInfo], shapes: dict[str, tuple[int, ...]], block: tuple[int, int]) -> None:
    for name, shape in shapes.items():
        info = tensors[name]
        if info.shape != shape:
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        if info.dtype == "F8_E4M3":
            if len(shape) != 2:
                raise CheckpointError(f"{info.file}: FP8 tensor {name!r} is not a 2-D weight")
            scale = tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                raise CheckpointError(f"{info.file}: FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
            blocks = tuple(-(-dim // b) for dim, b in zip(shape, block))
            if scale.shape != blocks:
                raise CheckpointError(
                    f"{scale.file}: tensor {name + SCALE_SUFFIX!r} has shape {list(scale.shape)}, "
                    f"expected {list(blocks)} for weight_block_size {list(block)}"
                )
        elif info.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(f"{info.file}: tensor {name!r} has unsupported dtype {info.dtype}")


def _listing(names: list[str]) -> str:
    more = f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


class _OpenFiles:
    """Safetensors files opened on first use and kept open (memory-mapped) until the stack closes."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack, self.handles = stack, {}

    def read(self, name: str, tensors: dict[str, TensorInfo], block: tuple[int, int]) -> torch.Tensor:
        """The tensor `name`, dequantized to float32 when it is FP8."""
        tensor = self._get(name, tensors[name].file)
        if tensors[name].dtype != "F8_E4M3":
            return tensor
        scale_name = name + SCALE_SUFFIX
        return dequantize_fp8(tensor, self._get(scale_name, tensors[scale_name].file), block)

    def _get(self, name: str, path: Path) -> torch.Tensor:
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        try:
            return self.handles[path].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({str(e).splitlines()[0]})") from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating tensors as `dtype`, so modules are allocated once, in the loaded dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
