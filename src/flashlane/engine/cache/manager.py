"""Hybrid cache manager: sizes the pools once from a memory budget, hands pages and state slots
to requests and takes them back (finish, abort, preemption), and runs the prefix cache.

Prefix cache (``prefix_caching=True``): full pages are registered under a chained block key
(``block_hash``) and shared by reference count (``page_pool``); models with per-sequence state
also need a state checkpoint at the hit boundary (``checkpoints``). A hit is the longest prefix
of full pages for which pages *and* (for stateful models) a checkpoint exist, in the pool or a
lower tier (``tiers``). Checkpoints are saved where the next request is likely to start: at the
last full page of the prompt, at every page-aligned prefill chunk end, where a lookup's page
match ran past its last checkpoint (so the next request with that prefix hits there), and at
the latest page boundary of the output (kept rolling: a request keeps only its newest one).
A request that asks for prompt logprobs does not read the cache (``scores_prompt``).

What a request holds (block table, state slot, block keys, checkpoint stops, its rolling
checkpoint, staged lower-tier entries) lives here, in a ``Holding`` per request id; the request
itself is written by the scheduler alone, from what ``admit`` returns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import psutil
import torch

from ...cache_spec import CacheSpec
from .allocator import FreeList
from .block_hash import extend_keys, root_key
from .checkpoints import CheckpointPool
from .holdings import Admission, Holding
from .page_pool import PagePool
from .pools import allocate_pools, dtype_name
from .snapshots import StateSnapshots
from .tiers import CacheTiers

log = logging.getLogger("flashlane.cache")


@dataclass(frozen=True)
class CachePlan:
    num_pages: int
    num_slots: int
    page_size: int
    bytes_per_page: int
    bytes_per_slot: int
    num_checkpoints: int = 0
    num_draft_rows: int = 0      # speculative decoding: a state row per slot, to roll rejected drafts back

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


def plan_cache(spec: CacheSpec, dtype: torch.dtype, cache_memory: float | int, max_num_seqs: int,
               num_pages: int | None = None, num_slots: int | None = None,
               device: torch.device | str = "cpu", checkpoint_share: float = 0.0,
               num_checkpoints: int | None = None, draft_rollback: bool = False) -> CachePlan:
    """Split a budget between state slots (one per running sequence, first), checkpoints
    (``checkpoint_share`` of the budget, stateful models only) and pages (the rest).
    ``draft_rollback`` (speculative decoding): every slot gets a second row, where its state is
    kept while drafts are verified.

    ``cache_memory``: bytes (int) or a fraction of currently free device memory (float <= 1)."""
    name = dtype_name(dtype)
    bytes_per_page = max(spec.bytes_per_page(name), 1)
    bytes_per_slot = spec.bytes_per_slot(name)
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
    if num_checkpoints is None:
        num_checkpoints = int(checkpoint_share * budget) // bytes_per_slot if bytes_per_slot else 0
    if not spec.needs_state_slot:
        num_checkpoints = 0
    draft_rows = num_slots if draft_rollback and spec.needs_state_slot else 0
    if num_pages is None:
        num_pages = (budget - (num_slots + num_checkpoints) * bytes_per_slot
                     - draft_rows * spec.draft_rollback_bytes_per_sequence(name)) // bytes_per_page
    if num_pages < 1:
        raise ValueError(f"cache budget of {budget} bytes leaves no room for a single page "
                         f"({bytes_per_page} bytes per page, {num_slots} slots, {num_checkpoints} "
                         f"checkpoints and {draft_rows} draft rollback rows of {bytes_per_slot} bytes)")
    return CachePlan(int(num_pages), int(num_slots), spec.page_size, bytes_per_page, bytes_per_slot,
                     int(num_checkpoints), int(draft_rows))


def _free_memory(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


@dataclass
class PrefixMatch:
    """What a lookup found for a request: reuse the first ``num_tokens`` tokens."""

    num_tokens: int = 0
    pages: list[tuple[bytes, str, int]] = field(default_factory=list)   # (key, tier, pool page or 0)
    checkpoint: tuple[bytes, str] | None = None                          # (key, tier)
    page_match_tokens: int = 0     # tokens whose pages exist (may run past the last checkpoint)

    @property
    def pool_pages(self) -> list[int]:
        return [p for _, tier, p in self.pages if tier == "pool"]


def scores_prompt(req) -> bool:
    """A request still owed prompt logprobs computes every prompt position, so it reads nothing
    from the prefix cache (a hit's positions have no logits); the full pages it computes are
    still registered for later requests. Once its prompt is scored (e.g. preempted while
    decoding) it may hit again."""
    return req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens


class CacheManager:
    def __init__(self, spec: CacheSpec, plan: CachePlan, dtype: torch.dtype, device="cpu",
                 prefix_caching: bool = False, fingerprint: str = "", host_cache_memory: int = 0,
                 disk_cache_dir: str | None = None, disk_cache_bytes: int | None = None,
                 disk_load_timeout_s: float = 5.0):
        self.spec = spec
        self.plan = plan
        rows = 1 + plan.num_slots + plan.num_checkpoints + plan.num_draft_rows if spec.needs_state_slot else 0
        self.tensors = allocate_pools(spec, plan.num_pages + 1, rows, dtype, device)
        self.snapshots = StateSnapshots(self.tensors)
        self.prefix_caching = prefix_caching
        self.stateful = spec.needs_state_slot
        # the layout is part of every key: an int8 page is never served to a bf16/fp32 run
        kv = spec.kv_dtype_name(dtype_name(dtype))
        self._root = root_key(f"{fingerprint}|{spec.page_size}|{spec.kpool}|{dtype}|kv={kv}|{spec.layout_key()}")
        self.tiers = None
        if prefix_caching and (host_cache_memory or disk_cache_dir):
            self.tiers = CacheTiers(host_cache_memory, disk_cache_dir, disk_cache_bytes, namespace=self._root.hex(),
                                    load_timeout_s=disk_load_timeout_s)
        self.pages = PagePool(plan.num_pages, on_evict=self._offload_page, on_forget=self._forget)
        self.slots = FreeList(plan.num_slots, "state slots")
        self.checkpoints = CheckpointPool(self.snapshots, 1 + plan.num_slots, plan.num_checkpoints,
                                          on_evict=self._offload_checkpoint)
        self.counters = {"queries": 0, "hits": 0, "hits_pool": 0, "hits_host": 0, "hits_disk": 0,
                         "checkpoint_restores": 0}
        self._holdings: dict[str, Holding] = {}

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    # ---- what a request holds --------------------------------------------------------------------
    def _held(self, req) -> Holding:
        return self._holdings[req.request_id]

    def block_table(self, req) -> list[int]:
        """The pool pages of ``req``'s tokens, in order (empty when it holds none)."""
        held = self._holdings.get(req.request_id)
        return held.block_table if held is not None else []

    def state_slot(self, req) -> int:
        """The state row of ``req`` (0: none)."""
        held = self._holdings.get(req.request_id)
        return held.state_slot if held is not None else 0

    def draft_row(self, req) -> int:
        """The row where ``req``'s state waits while its drafts are verified (0: none needed)."""
        slot = self.state_slot(req)
        if not slot:
            return 0
        if not self.plan.num_draft_rows:
            raise RuntimeError("speculative decoding on a stateful model needs a cache planned with draft_rollback")
        return self.plan.num_slots + self.plan.num_checkpoints + slot

    @property
    def checkpoints_decode(self) -> bool:
        """True when decoding requests take state checkpoints at page boundaries."""
        return self.prefix_caching and self.stateful and self.checkpoints.capacity > 0

    def checkpoint_stops(self, req) -> list[int]:
        """Positions where the prefill of ``req`` pauses so a checkpoint is taken (set by ``match``)."""
        return self._held(req).checkpoint_stops

    # ---- keys and lookup -------------------------------------------------------------------------
    def block_keys(self, req, num_pages: int) -> list[bytes]:
        keys = self._held(req).block_keys
        if len(keys) < num_pages:   # (copying a long prompt's ids to find nothing new costs a waiting request each step)
            extend_keys(keys, req.all_token_ids[: num_pages * self.page_size], self.page_size, self._root)
        return keys[:num_pages]

    def match(self, req) -> PrefixMatch:
        """The longest reusable prefix of a waiting ``req`` (always leaving its last token to
        compute); also sets where its prefill will pause for checkpoints."""
        held = self._holdings.setdefault(req.request_id, Holding())
        found = self._lookup(req)
        held.checkpoint_stops = self._checkpoint_stops(req, found)
        return found

    def _lookup(self, req) -> PrefixMatch:
        if not self.prefix_caching or scores_prompt(req):
            return PrefixMatch()
        if self.tiers is not None:
            self.tiers.expire_loads()      # a load past its deadline no longer counts as on disk
        keys = self.block_keys(req, (req.num_tokens - 1) // self.page_size)
        pages: list[tuple[bytes, str, int]] = []
        for k in keys:
            p = self.pages.page_of.get(k)
            if p is not None:
                pages.append((k, "pool", p))
                continue
            tier = self._tier_of("page", k, req)
            if tier is None:
                break
            pages.append((k, tier, 0))
        found = PrefixMatch(page_match_tokens=len(pages) * self.page_size)
        usable = len(pages)
        if self.stateful:
            usable = 0
            for n in range(len(pages), 0, -1):
                k = pages[n - 1][0]
                tier = "pool" if k in self.checkpoints else self._tier_of("checkpoint", k, req)
                if tier is not None:
                    usable, found.checkpoint = n, (k, tier)
                    break
        found.pages = pages[:usable]
        found.num_tokens = usable * self.page_size
        return found

    def _tier_of(self, kind: str, key: bytes, req) -> str | None:
        if (kind, key) in self._held(req).staged:
            return "disk"
        return self.tiers.tier_of(kind, key) if self.tiers else None

    def needs_load(self, match: PrefixMatch, req) -> bool:
        """True when part of the hit sits on disk and is not staged yet: start it loading off the
        step (the request waits; others are not held up). Bounded: each such key is staged, found
        unreadable or given up at the load deadline, and the next ``match`` no longer needs it."""
        wanted = [("page", k) for k, tier, _ in match.pages if tier == "disk"]
        if match.checkpoint and match.checkpoint[1] == "disk":
            wanted.append(("checkpoint", match.checkpoint[0]))
        staged = self._held(req).staged
        missing = [w for w in wanted if w not in staged]
        if not missing:
            return False
        self.tiers.prefetch(missing, staged)
        return True

    # ---- admission -------------------------------------------------------------------------------
    def pages_needed(self, req, num_tokens: int) -> int:
        """Extra pages ``req`` needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.page_size) - len(self._held(req).block_table))

    def can_admit(self, req, num_tokens: int, match: PrefixMatch | None = None) -> bool:
        if self.stateful and self._held(req).state_slot == 0 and self.slots.num_free == 0:
            return False
        if match is None or not match.pages:
            return self.pages_needed(req, num_tokens) <= self.pages.num_free
        hit_pool = match.pool_pages
        need = -(-num_tokens // self.page_size) - len(hit_pool)
        reclaimable = self.pages.num_free - sum(1 for p in hit_pool if self.pages.is_evictable(p))
        return need <= reclaimable

    def admit(self, req, match: PrefixMatch, num_tokens: int) -> Admission:
        """Give a waiting request its hit pages (loading lower-tier ones), restore the hit's
        checkpoint into its slot, then grow it to ``num_tokens``. Returns where its computation
        starts and, at its first admission, how many prompt tokens the cache supplied."""
        held = self._held(req)
        # read lower-tier data first: allocating pool pages below may push host entries out
        loads = {key: self._tier_data("page", key, tier, req) for key, tier, _ in match.pages if tier != "pool"}
        ckpt = None
        if match.checkpoint is not None and match.checkpoint[1] != "pool":
            ckpt = self._tier_data("checkpoint", *match.checkpoint, req)
        self.pages.acquire(match.pool_pages)       # before allocating, so allocation cannot evict them
        table, parent = [], None
        for key, tier, page in match.pages:
            if tier != "pool":
                page = self.pages.allocate(1)[0]
                self._write_page(loads[key], page)
                self.pages.register(page, key, parent)
            table.append(page)
            parent = key
        held.block_table = table
        self._take_slot(held)
        if match.checkpoint is not None:
            key, tier = match.checkpoint
            if tier == "pool":
                self.checkpoints.restore(key, held.state_slot)
            else:
                self.snapshots.load(ckpt, held.state_slot)
                self.checkpoints.store(key, ckpt)
            self.counters["checkpoint_restores"] += 1
        held.staged.clear()
        cached = None
        if req.num_cached_tokens is None:
            cached = min(match.num_tokens, req.num_prompt_tokens)
            if not scores_prompt(req):   # a request that never looked is no query
                self._count_query(req, match, cached)
        self.grow(req, num_tokens)
        return Admission(match.num_tokens, cached)

    def _count_query(self, req, match: PrefixMatch, cached: int) -> None:
        c = self.counters
        c["queries"] += req.num_prompt_tokens
        c["hits"] += cached
        for _, tier, _ in match.pages[: cached // self.page_size]:
            c[f"hits_{tier}"] += self.page_size

    def _checkpoint_stops(self, req, match: PrefixMatch) -> list[int]:
        """Page-aligned positions where this prefill must pause so a checkpoint is taken there."""
        if not (self.prefix_caching and self.stateful and self.checkpoints.capacity):
            return []
        last_full = (req.num_tokens - 1) // self.page_size * self.page_size
        stops = {last_full, match.page_match_tokens}
        return sorted(s for s in stops if match.num_tokens < s < req.num_tokens)

    def _take_slot(self, held: Holding) -> None:
        if self.stateful and held.state_slot == 0:
            held.state_slot = self.slots.allocate(1)[0]
            self.snapshots.clear(held.state_slot)

    def grow(self, req, num_tokens: int) -> None:
        """Give ``req`` a state slot (if the model keeps state) and pages for ``num_tokens``."""
        held = self._held(req)
        self._take_slot(held)
        held.block_table.extend(self.pages.allocate(self.pages_needed(req, num_tokens)))

    def release(self, req) -> None:
        """``req`` is done (finished or aborted): give back what it holds and forget its holding."""
        held = self._holdings.pop(req.request_id, None)
        if held is not None:
            self._give_back(held)

    def preempt(self, req) -> None:
        """``req`` is preempted by recompute: give back its pages and slot, but keep its block
        keys and rolling checkpoint for when it is admitted again."""
        held = self._holdings.get(req.request_id)
        if held is not None:
            self._give_back(held)

    def _give_back(self, held: Holding) -> None:
        """Private pages are freed; registered full pages stay cached until their space is needed."""
        if held.block_table:
            self.pages.release(held.block_table)
            held.block_table = []
        if held.state_slot:
            self.snapshots.clear(held.state_slot)
            self.slots.free([held.state_slot])
            held.state_slot = 0
        held.staged.clear()

    # ---- after a step ----------------------------------------------------------------------------
    def commit(self, req, computed_before: int, prefill: bool) -> None:
        """``req`` now has ``req.num_computed_tokens`` tokens in the cache: register its newly full
        pages and take the checkpoints due at this position."""
        if not self.prefix_caching:
            return
        held = self._held(req)
        done = req.num_computed_tokens
        full = done // self.page_size
        first = computed_before // self.page_size
        if full > first:
            keys = self.block_keys(req, full)
            for i in range(first, full):
                self.pages.register(held.block_table[i], keys[i], keys[i - 1] if i else None)
        if not (self.stateful and done % self.page_size == 0 and full > first):
            return
        key = self.block_keys(req, full)[-1]
        if prefill:
            self.checkpoints.save(key, held.state_slot)
            return
        # decode: keep only the newest boundary of this request's output
        if held.rolling_checkpoint is not None and held.rolling_checkpoint != key:
            self.checkpoints.drop(held.rolling_checkpoint)
        if self.checkpoints.save(key, held.state_slot):
            held.rolling_checkpoint = key

    # ---- tiers -----------------------------------------------------------------------------------
    def export_page(self, page: int) -> dict[str, torch.Tensor]:
        out = {}
        for p in self.spec.pools():
            if p.unit == "page":
                t = self.tensors.pools[p.name]
                out[p.name] = t[:, page * p.per_unit:(page + 1) * p.per_unit].to("cpu", copy=True)
        return out

    def _write_page(self, data: dict[str, torch.Tensor], page: int) -> None:
        for p in self.spec.pools():
            if p.unit == "page":
                self.tensors.pools[p.name][:, page * p.per_unit:(page + 1) * p.per_unit].copy_(data[p.name])

    def _tier_data(self, kind: str, key: bytes, tier: str, req) -> dict[str, torch.Tensor]:
        return self._held(req).staged[(kind, key)] if tier == "disk" else self.tiers.get(kind, key)

    def _offload_page(self, key: bytes, page: int) -> bool:
        if self.tiers is None:
            return False
        return self.tiers.put("page", key, self.export_page(page))

    def _offload_checkpoint(self, key: bytes, row: int) -> None:
        if self.tiers is not None:
            self.tiers.put("checkpoint", key, self.snapshots.export(row))

    def _forget(self, key: bytes) -> None:
        """A page key left the pool: its checkpoint is only useful while a tier keeps the page."""
        if key in self.checkpoints and not (self.tiers and self.tiers.tier_of("page", key)):
            self.checkpoints.drop(key)

    def close(self, writeback_timeout_s: float = 5.0) -> None:
        """Write back: every cached page and checkpoint goes to the disk tier (if there is one),
        so a server restarted on the same directory finds them; then stop the loader thread.
        Bounded and best effort: what is not written within ``writeback_timeout_s`` is skipped
        (counted as ``disk_writeback_skipped``), and no tier fault is raised from here."""
        if self.tiers is None:
            return
        try:
            if self.tiers.disk is not None:
                self._write_back(writeback_timeout_s)
        except Exception:
            log.exception("prefix cache write-back failed; skipped")
        try:
            self.tiers.close()
        except Exception:
            log.exception("prefix cache tiers did not close cleanly")

    def _write_back(self, timeout_s: float) -> None:
        entries = [("page", k, p) for k, p in self.pages.page_of.items()]
        entries += [("checkpoint", k, row) for k, row in self.checkpoints.items()]
        if not entries:
            return
        written = [0]
        deadline = time.monotonic() + timeout_s

        def run() -> None:
            try:
                for kind, key, where in entries:
                    if time.monotonic() > deadline or not self.tiers.disk_writable:
                        return
                    data = self.export_page(where) if kind == "page" else self.snapshots.export(where)
                    self.tiers.persist(kind, key, data)
                    written[0] += 1
            except Exception:
                log.exception("prefix cache write-back failed; the rest is skipped")

        # on a thread: one write stuck in the kernel (a hung filesystem) must not hold shutdown
        worker = threading.Thread(target=run, name="flashlane-cache-writeback", daemon=True)
        worker.start()
        worker.join(timeout_s)
        skipped = len(entries) - written[0]
        if skipped:
            self.tiers.count("disk_writeback_skipped", skipped)
            log.warning("prefix cache write-back: %d of %d entries not written (deadline %gs, or the disk tier "
                        "stopped taking writes); skipped", skipped, len(entries), timeout_s)

    # ---- reporting -------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        out = {
            "pages_total": self.pages.capacity, "pages_used": self.pages.num_used,
            "pages_free": self.pages.num_free - self.pages.num_cached, "pages_cached": self.pages.num_cached,
            "slots_total": self.slots.capacity, "slots_used": self.slots.num_used,
            "slots_free": self.slots.num_free,
            "checkpoints_total": self.checkpoints.capacity, "checkpoints_used": self.checkpoints.num_used,
        }
        if self.tiers is not None:
            out.update(self.tiers.usage())
        return out

    def prefix_stats(self) -> dict[str, int]:
        out = {f"prefix_cache_{k}": v for k, v in self.counters.items()}
        out["prefix_cache_page_evictions"] = self.pages.num_evicted
        out["prefix_cache_checkpoint_evictions"] = self.checkpoints.num_evicted
        out["prefix_cache_checkpoints_saved"] = self.checkpoints.num_saved
        if self.tiers is not None:
            out.update({f"prefix_cache_{k}": v for k, v in self.tiers.counters.items()})
        return out
