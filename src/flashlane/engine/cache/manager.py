"""Hybrid cache manager: sizes the pools once from a memory budget, then hands pages and state
slots to requests and takes them back (on finish, abort or preemption)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch

from ...cache_spec import CacheSpec
from ...models.forward_batch import CacheTensors
from .allocator import FreeList


@dataclass(frozen=True)
class CachePlan:
    num_pages: int
    num_slots: int
    page_size: int
    bytes_per_page: int
    bytes_per_slot: int

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_slots * self.bytes_per_slot


def element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def plan_cache(spec: CacheSpec, dtype: torch.dtype, cache_memory: float | int, max_num_seqs: int,
               num_pages: int | None = None, num_slots: int | None = None,
               device: torch.device | str = "cpu") -> CachePlan:
    """Split a budget between state slots (one per running sequence, first) and pages (the rest).

    ``cache_memory``: bytes (int) or a fraction of currently free device memory (float <= 1)."""
    es = element_size(dtype)
    per_token = len(spec.latent_layers) * spec.latent_dim * es + len(spec.index_layers) * spec.index_dim * es / spec.kpool
    bytes_per_page = max(int(math.ceil(per_token * spec.page_size)), 1)
    h, dk, dv = spec.state_shape
    bytes_per_slot = (len(spec.kda_layers) * (h * dk * dv * 4 + spec.conv_dim * spec.conv_width * es)
                      + (len(spec.index_layers) * spec.kpool * 2 * spec.index_dim * es if spec.kpool > 1 else 0))
    if isinstance(cache_memory, float) and cache_memory <= 1.0:
        if cache_memory <= 0:
            raise ValueError(f"cache_memory fraction must be > 0, got {cache_memory}")
        budget = int(cache_memory * _free_memory(device))
    else:
        budget = int(cache_memory)
        if budget <= 0:
            raise ValueError(f"cache_memory must be > 0 bytes, got {cache_memory}")
    if num_slots is None:
        num_slots = max_num_seqs if spec.needs_state_slot else 0
        if spec.needs_state_slot and bytes_per_slot:
            # keep at least half the budget for pages when slots are expensive
            num_slots = max(1, min(num_slots, budget // 2 // bytes_per_slot))
    if num_pages is None:
        num_pages = (budget - num_slots * bytes_per_slot) // bytes_per_page
    if num_pages < 1:
        raise ValueError(f"cache budget of {budget} bytes leaves no room for a single page "
                         f"({bytes_per_page} bytes per page, {num_slots} slots of {bytes_per_slot} bytes)")
    return CachePlan(int(num_pages), int(num_slots), spec.page_size, bytes_per_page, bytes_per_slot)


def _free_memory(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


class CacheManager:
    def __init__(self, spec: CacheSpec, plan: CachePlan, dtype: torch.dtype, device="cpu"):
        self.spec = spec
        self.plan = plan
        self.tensors = CacheTensors.allocate(spec, plan.num_pages + 1, plan.num_slots, dtype, device)
        self.pages = FreeList(plan.num_pages, "pages")
        self.slots = FreeList(plan.num_slots, "state slots")

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    def pages_needed(self, req, num_tokens: int) -> int:
        """Extra pages ``req`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def can_admit(self, req, num_tokens: int) -> bool:
        need_slot = self.spec.needs_state_slot and req.slot == 0
        if need_slot and self.slots.num_free == 0:
            return False
        return self.pages_needed(req, num_tokens) <= self.pages.num_free

    def grow(self, req, num_tokens: int) -> None:
        """Give ``req`` a state slot (if the model keeps state) and pages for ``num_tokens``."""
        if self.spec.needs_state_slot and req.slot == 0:
            req.slot = self.slots.allocate(1)[0]
            self.tensors.clear_slot(req.slot)
        req.pages.extend(self.pages.allocate(self.pages_needed(req, num_tokens)))

    def release(self, req) -> None:
        """Return every page and the slot of ``req`` (finish, abort, preemption)."""
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req.slot:
            self.tensors.clear_slot(req.slot)
            self.slots.free([req.slot])
            req.slot = 0

    def usage(self) -> dict[str, int]:
        return {
            "pages_total": self.pages.capacity, "pages_used": self.pages.num_used,
            "pages_free": self.pages.num_free, "slots_total": self.slots.capacity,
            "slots_used": self.slots.num_used, "slots_free": self.slots.num_free,
        }
