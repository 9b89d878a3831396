"""Checkpoint tensor names: published layouts <-> flashlane names (= transformers in-memory names).

Published ``glm5_next`` / ``glm_moe_dsa`` checkpoints (spec §3) store some tensors split or
differently named than the in-memory modules: KDA q/k/v short convs separately, the forget gate
projections directly under ``self_attn``, mHC parameters as ``hc_attn_*``, routed experts one
tensor per expert, and FP8 weights with a ``*_scale_inv`` block scale. ``to_flashlane`` folds a
published state dict into in-memory names; ``to_published`` is its inverse (used to write
published-name test checkpoints). llama checkpoints need no renaming.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch

from ..config import ModelConfig

FP8_BLOCK = 128
GLM5_PREFIX = "model.language_model."
SKIP_PREFIXES = ("model.visual.",)

_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^(?P<pre>.*\.self_attn)\.(?P<which>[qkv])_conv1d\.weight$")
_FGATE = re.compile(r"^(?P<pre>.*\.self_attn)\.(?P<name>f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_HC = re.compile(r"^(?P<pre>.*\.layers\.\d+)\.hc_(?P<site>attn|ffn)_(?P<part>fn|base|scale)$")


class WeightNameError(ValueError):
    """A checkpoint whose tensors cannot be arranged into the model's names."""


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "?") -> torch.Tensor:
    """``weight`` (e4m3, [out, in]) times its per-128x128-block ``scale_inv`` [ceil(out/128), ceil(in/128)]."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise WeightNameError(f"{name}: FP8 block dequantisation needs 2-D weight and scale, "
                              f"got {tuple(weight.shape)} and {tuple(scale_inv.shape)}")
    out, inp = weight.shape
    want = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise WeightNameError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} "
                              f"for a {tuple(weight.shape)} weight in {FP8_BLOCK}x{FP8_BLOCK} blocks")
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    return weight.float() * scale


def to_flashlane(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a checkpoint (published or already in-memory names) to flashlane parameter names."""
    src = {n: t for n, t in tensors.items() if not n.startswith(SKIP_PREFIXES)}
    src = _dequantize_all(src)
    if cfg.arch == "glm5_next" and src and not any(n.startswith(GLM5_PREFIX) for n in src):
        # a text-only export (model.layers.*, model.norm.*): re-home it under the text tower
        src = {(GLM5_PREFIX + n[len("model."):] if n.startswith("model.") else n): t for n, t in src.items()}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    convs: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in src.items():
        if m := _EXPERT.match(name):
            experts[m["pre"]][m["proj"]][int(m["e"])] = t
        elif m := _CONV.match(name):
            convs[m["pre"]][m["which"]] = t
        elif m := _FGATE.match(name):
            if m["name"] == "A_log":
                t = t.reshape(-1)
            out[f"{m['pre']}.forget_gate.{m['name']}"] = t
        elif m := _HC.match(name):
            out[f"{m['pre']}.{m['site']}_hc.{m['part']}"] = t
        else:
            out[name] = t
    for pre, parts in convs.items():
        missing = [w for w in "qkv" if w not in parts]
        if missing:
            raise WeightNameError(f"{pre}: {', '.join(w + '_conv1d.weight' for w in missing)} missing "
                                  "(the q/k/v short convs come as a set)")
        out[f"{pre}.conv1d.weight"] = torch.cat([parts[w] for w in "qkv"], 0)
    for pre, projs in experts.items():
        out.update(_fuse_experts(pre, projs))
    return out


def _dequantize_all(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    scales = [n for n in src if n.endswith("_scale_inv")]
    if not scales:
        return src
    src = dict(src)
    for s in scales:
        base = s[: -len("_scale_inv")]
        if base not in src:
            raise WeightNameError(f"{s} has no weight {base} to scale")
        src[base] = dequantize_fp8_blocks(src[base], src.pop(s), base)
    return src


def _fuse_experts(pre: str, projs: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    counts = {p: sorted(d) for p, d in projs.items()}
    ids = counts.get("gate_proj", [])
    for p in ("gate_proj", "up_proj", "down_proj"):
        if p not in counts:
            raise WeightNameError(f"{pre}: no per-expert {p}.weight tensors")
        if counts[p] != list(range(len(counts[p]))) or counts[p] != ids:
            have = set(counts[p])
            gap = next((e for e in range(max(ids + counts[p]) + 1) if e not in have), None)
            raise WeightNameError(f"{pre}.{gap}.{p}.weight is missing (experts must be numbered 0..E-1)")
    gate = torch.stack([projs["gate_proj"][e] for e in ids])
    up = torch.stack([projs["up_proj"][e] for e in ids])
    down = torch.stack([projs["down_proj"][e] for e in ids])
    return {f"{pre}.gate_up_proj": torch.cat((gate, up), 1), f"{pre}.down_proj": down}


def to_published(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of ``to_flashlane`` (without FP8 quantisation): the names a published checkpoint uses."""
    if cfg.arch == "llama":
        return dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            pre = name[: -len(".gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{pre}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            pre = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = t[e].contiguous()
        elif name.endswith(".self_attn.conv1d.weight"):
            pre = name[: -len(".conv1d.weight")]
            for which, part in zip("qkv", t.chunk(3, 0)):
                out[f"{pre}.{which}_conv1d.weight"] = part.contiguous()
        elif ".self_attn.forget_gate." in name:
            out[name.replace(".forget_gate.", ".")] = t
        elif m := re.match(r"^(.*\.layers\.\d+)\.(attn|ffn)_hc\.(fn|base|scale)$", name):
            out[f"{m[1]}.hc_{m[2]}_{m[3]}"] = t
        else:
            out[name] = t
    return out


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style e4m3 128x128 block quantisation (for writing FP8 test checkpoints)."""
    out, inp = weight.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:out, :inp].to(torch.float8_e4m3fn)
    return q, scale
