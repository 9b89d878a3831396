"""Load Hugging Face checkpoint folders into flashlane models, strictly; or initialise randomly.

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Tensor names may be transformers' in-memory names or the
published layout (spec §3); ``weights.to_flashlane`` folds the latter. Every missing,
unexpected or wrongly shaped tensor, missing shard and malformed index is a ``LoadError``
naming the tensor or file.

dtype "auto": on CPU bfloat16 only where the CPU has native bf16 (AVX512_BF16 / AMX) and a
start-up timing finds it at least 10% faster than float32 at 64 rows and no slower at 1 row, else float32
(``kernels.cpu_caps``; the environment variable ``FLASHLANE_AUTO_DTYPE=float32|bfloat16`` pins
it, as the tests do); on GPU the checkpoint's ``dtype`` / ``torch_dtype``, else bfloat16.
A few small tensors that the reference keeps in fp32 stay fp32 whatever the model dtype
(``FP32_PARAMS``; a model class may override with a ``keep_fp32_params`` attribute: the
``KeepsFp32Params`` protocol).
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.cpu_caps import DtypeChoice, auto_cpu_dtype
from .protocol import fp32_param_names
from .weights import WeightNameError, to_flashlane

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FP32_PARAMS = ("e_score_correction_bias", "A_log", "dt_bias", "attn_hc.", "ffn_hc.", "index_kpool_compress_ape")
AUTO_DTYPE_ENV = "FLASHLANE_AUTO_DTYPE"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor, file or field."""


# ---- dtype ---------------------------------------------------------------------------------

def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig | None = None,
                  device: str | torch.device = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise LoadError(f"dtype {dtype!r} is not supported (choose auto, {', '.join(DTYPES)})")
        return DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return DTYPES[auto_cpu_dtype_choice().dtype]
    raw = cfg.raw if cfg is not None else {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    declared = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return DTYPES.get(str(declared).replace("torch.", ""), torch.bfloat16)


def auto_cpu_dtype_choice() -> DtypeChoice:
    """What dtype "auto" means on this CPU, and why (for the start-up report)."""
    pinned = os.environ.get(AUTO_DTYPE_ENV)
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise LoadError(f"{AUTO_DTYPE_ENV}={pinned!r}: choose float32 or bfloat16")
        return DtypeChoice(pinned, f"pinned by {AUTO_DTYPE_ENV}")
    return auto_cpu_dtype()


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    keep = fp32_param_names(model, FP32_PARAMS)
    model.to(dtype)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and any(k in name for k in keep):
            t.data = t.data.float()
    return model


# ---- reading a folder ----------------------------------------------------------------------

def checkpoint_files(folder: str | Path) -> dict[Path, list[str] | None]:
    """Safetensors files of a folder -> the tensor names the index promises in each
    (None for an un-indexed single file)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LoadError(f"{index} is malformed (needs a JSON object with a 'weight_map'): {exc}") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index}: 'weight_map' must be a non-empty object of tensor -> shard file")
        files: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(folder / str(shard), []).append(name)
        for path in files:
            if not path.is_file():
                raise LoadError(f"shard {path.name} named by {INDEX_FILE} is missing from {folder}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return {found[0]: None}
    if found:
        raise LoadError(f"{folder} has {len(found)} safetensors files but no {INDEX_FILE} saying which tensor is where")
    other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {', '.join(other)}: only safetensors are supported)" if other else ""
    raise LoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}{hint}")


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for path, promised in checkpoint_files(folder).items():
        try:
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for name in promised or []:
                    if name not in names:
                        raise LoadError(f"tensor {name} is listed in {INDEX_FILE} under {path.name} "
                                        "but that file lacks it")
                for name in names:
                    if name in out:
                        raise LoadError(f"tensor {name} appears in more than one checkpoint file "
                                        f"(again in {path.name})")
                    out[name] = f.get_tensor(name)
        except SafetensorError as exc:
            raise LoadError(f"{path.name} is not a readable safetensors file: {exc}") from exc
        except OSError as exc:
            raise LoadError(f"cannot read {path}: {exc}") from exc
    return out


# ---- putting tensors into a model ----------------------------------------------------------

def is_mtp_name(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a next-token-prediction layer (stored after the last trunk layer)."""
    m = _LAYER.search(name)
    return m is not None and int(m.group(1)) >= cfg.num_layers


def load_state(model: nn.Module, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> list[str]:
    """Copy checkpoint tensors into ``model`` by name (after mapping published names).

    Strict: every model tensor must be provided with its exact shape, nothing may be left over.
    Exceptions: a tied ``lm_head.weight`` may be absent; next-token-prediction (MTP) layers at
    index >= num_layers are dropped when the model has no place for them, and may be absent
    altogether (not partially) when it has. Returns the names it dropped.
    """
    try:
        named = to_flashlane(tensors, cfg)
    except WeightNameError as exc:
        raise LoadError(str(exc)) from exc
    named = {n: t for n, t in named.items() if not _IGNORED.search(n)}
    expected = model.state_dict(keep_vars=True)
    dropped = sorted(n for n in named if n not in expected and is_mtp_name(n, cfg))
    unexpected = sorted(n for n in named if n not in expected and n not in dropped)
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise LoadError(f"unexpected tensor(s) in checkpoint: {', '.join(unexpected[:5])}{more}")
    missing = [n for n in expected if n not in named]
    if cfg.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    mtp_missing = [n for n in missing if is_mtp_name(n, cfg)]
    if mtp_missing and not any(is_mtp_name(n, cfg) for n in named):
        missing = [n for n in missing if not is_mtp_name(n, cfg)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"checkpoint lacks tensor(s): {', '.join(missing[:5])}{more}")
    for name, t in named.items():
        if name in dropped:
            continue
        target = expected[name]
        if tuple(target.shape) != tuple(t.shape):
            raise LoadError(f"tensor {name} has shape {tuple(t.shape)} in the checkpoint, "
                            f"the model expects {tuple(target.shape)}")
    with torch.no_grad():
        for name, t in named.items():
            if name not in dropped and not (cfg.tie_word_embeddings and name == "lm_head.weight"
                                            and "model.embed_tokens.weight" in named):
                expected[name].copy_(t)
    return dropped


# ---- random weights ------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float = 0.02) -> torch.Tensor:
    """The value ``name`` gets under random init: a function of (seed, name, shape) only."""
    g = _generator(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if leaf == "dt_bias":  # inverse softplus of a log-uniform step in [1e-3, 1e-1]
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if leaf in ("e_score_correction_bias", "bias", "base"):
        return torch.zeros(shape)
    if leaf == "scale" or (len(shape) == 1 and leaf == "weight"):
        return torch.ones(shape)  # norm weights, mHC scales
    if name.endswith("conv1d.weight"):  # depthwise [C, 1, K]: fan-in K like nn.Conv1d's default
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=g)
    return torch.empty(shape).normal_(0.0, std, generator=g)


def random_state(model: nn.Module, seed: int, skip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Random values for every distinct tensor of ``model.state_dict()`` (tied copies once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    skip = set(skip)
    for name, t in model.state_dict(keep_vars=True).items():
        if name in skip or id(t) in seen:
            continue
        seen.add(id(t))
        if t.is_floating_point():
            out[name] = random_tensor(name, tuple(t.shape), seed)
    return out


def init_random(model: nn.Module, seed: int) -> nn.Module:
    state = random_state(model, seed)
    with torch.no_grad():
        own = model.state_dict(keep_vars=True)
        for name, value in state.items():
            own[name].copy_(value)
    return model


# ---- writing a folder ----------------------------------------------------------------------

def save_checkpoint(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping | None = None,
                    num_shards: int = 1) -> Path:
    """Write ``tensors`` as ``model.safetensors`` (or ``num_shards`` shards plus an index) and
    ``config.json``. Tensors sharing storage must be passed once (safetensors refuses aliases)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    items = [(n, t.detach().contiguous().cpu()) for n, t in tensors.items()]
    meta = {"format": "pt"}
    if num_shards <= 1:
        save_file(dict(items), str(folder / SINGLE_FILE), metadata=meta)
        return folder
    per = -(-len(items) // num_shards)
    weight_map, total = {}, 0
    for k in range(num_shards):
        part = dict(items[k * per:(k + 1) * per])
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(part, str(folder / fname), metadata=meta)
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder
