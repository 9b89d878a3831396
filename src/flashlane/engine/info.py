"""What an engine is, fixed once it has loaded: the model, its limits and the cache layout.

The engine builds one ``EngineInfo`` at start-up; the server reads it (in-process, or sent once
by the engine-core process) instead of reaching into the engine. ``report()`` is the start-up
report as a plain dict (``/v1/models``, eval results, the start-up log lines).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineInfo:
    model: str                      # the model's name (preset, folder or file stem)
    arch: str
    dtype: str                      # the weights' float dtype
    vocab_size: int
    max_model_len: int              # longest sequence, prompt plus output
    max_running: int                # sequences run at once
    page_size: int
    num_pages: int
    num_tokens: int                 # pages x page_size
    num_state_slots: int
    bytes_per_page: int
    bytes_per_slot: int
    cache_bytes: int
    latent_bytes_per_token: float
    index_bytes_per_token: float
    kv_cache_dtype: str
    pool_bytes_per_token: dict[str, float]
    index_topk: int | None
    config_index_topk: int | None
    prefix_caching: bool
    num_checkpoints: int
    bytes_per_checkpoint: int
    host_cache_bytes: int
    disk_cache_dir: str | None
    disk_cache_bytes: int | None
    scheduler: str
    static_batch_size: int | None
    weight_bytes: int
    quantization: dict | None       # what was quantised with which kernels (None: nothing)
    quantization_summary: str       # one line for the log: "no quantization" or what was done
    dtype_reason: str | None        # why dtype "auto" chose this dtype (None: not auto)
    # torch CPU threads of the process running the model, read when the info is built; a default
    # keeps callers that build an EngineInfo by hand working
    num_threads: int | None = None
    # how the engine process's freed host memory is kept (engine/host_malloc.py): {"kept", "why"};
    # None off CPU
    host_malloc: dict | None = None
    # static-graph decode (compile=True): {"sizes", "warmup_s", "cache_dir"}; None = eager only
    compiled_decode: dict | None = None
    # the kernel backend every model op runs on: {"name", "description"} (engine arg kernel_backend)
    kernel_backend: dict | None = None
    # float linears' weight format (engine arg linear_kernel): {"format", "why", "linears", "extra_bytes"}
    linear_kernel: dict | None = None
    # speculative decoding: the parsed speculative_config plus "rollback_rows" and "rollback_bytes"
    # (a state row per slot for stateful models, for eager verify steps), "verify_in_graphs" (None
    # without static graphs) and "verify_state_bytes" (the per-token states a verify step in graphs
    # keeps for every sequence of the largest bucket); None = off
    speculative: dict | None = None

    # fields of the info that are not part of the start-up report (kept as it always was)
    _NOT_REPORTED = ("vocab_size", "quantization_summary")

    def report(self) -> dict:
        """The start-up report: every field but the few above, as a fresh dict."""
        d = asdict(self)
        for k in self._NOT_REPORTED:
            del d[k]
        return d

    def describe_weights(self) -> str:
        """One line for the start-up log: the weights' dtype (and why, for "auto"), their bytes
        as held, the kernel backend, and what was quantised with which kernels."""
        line = f"weights {self.weight_bytes / 2**20:.1f} MiB {self.dtype}"
        if self.dtype_reason:
            line += f" (dtype auto: {self.dtype_reason})"
        if self.kernel_backend:
            line += f"; kernel backend {self.kernel_backend['description']}"
        if self.linear_kernel:
            lk = self.linear_kernel
            line += f"; linears {lk['format']}" + (f" ({lk['linears']} packed)" if lk["linears"] else "")
        if self.host_malloc:
            line += f"; host malloc: {self.host_malloc['why']}"
        return line + "; " + self.quantization_summary

    def describe_compile(self) -> str:
        """One line for the start-up log: how decode steps run."""
        c = self.compiled_decode
        if c is None:
            return "decode eager (compile off)"
        return (f"compiled decode for batch sizes {c['sizes']} (padded up to the next; more run eagerly), "
                f"warm-up {c['warmup_s']:.1f} s, Inductor cache {c['cache_dir']}")

    def describe_cache(self) -> str:
        """One line for the start-up log: what the pre-allocated pools hold and allow."""
        pools = " + ".join(f"{name} {b:g}" for name, b in self.pool_bytes_per_token.items())
        topk = "" if self.index_topk is None else (
            f"index_topk={self.index_topk} (config {self.config_index_topk}); ")
        return (f"cache {self.cache_bytes / 2**20:.1f} MiB, model {self.dtype}, kv {self.kv_cache_dtype}: "
                f"{self.num_pages} pages x {self.page_size} = {self.num_tokens} tokens ({pools} = "
                f"{sum(self.pool_bytes_per_token.values()):g} B/token), {self.num_state_slots} state slots "
                f"x {self.bytes_per_slot} B; max_running={self.max_running}, max_model_len={self.max_model_len}; "
                + topk + self._describe_prefix_cache() + self._describe_speculative())

    def _describe_speculative(self) -> str:
        s = self.speculative
        if not s:
            return ""
        rollback = (f"rollback {s['rollback_rows']} state rows = {s['rollback_bytes'] / 2**20:.2f} MiB"
                    if s["rollback_rows"] else "rollback: pages only (no per-sequence state)")
        what = (f"(n-gram {s['prompt_lookup_min']}-{s['prompt_lookup_max']})" if s["method"] == "ngram"
                else f"(MTP layer: {s.get('mtp_bytes_per_token', 0):g} B/token of the cache above)")
        if s.get("rejection_sample_method") == "synthetic":
            what += (f", SYNTHETIC acceptance, mean length {s['synthetic_acceptance_length']:g}: outputs are "
                     "not the model's (speed measurements only)")
        graphs = {None: "", True: ", verify steps through static graphs",
                  False: ", verify steps eager (per-sequence state, whole-model graphs)"}
        steps = s.get("verify_state_bytes", 0)
        steps = f" (per-token states {steps / 2**20:.2f} MiB: a rollback there is a copy)" if steps else ""
        return (f"; speculative decoding {s['method']} k={s['num_speculative_tokens']} {what}, {rollback}"
                + graphs[s.get("verify_in_graphs")] + steps)

    def _describe_prefix_cache(self) -> str:
        if not self.prefix_caching:
            return "prefix cache off"
        parts = [f"prefix cache on: {self.num_checkpoints} checkpoints x {self.bytes_per_checkpoint} B"]
        if self.host_cache_bytes:
            parts.append(f"host tier {self.host_cache_bytes / 2**20:.1f} MiB")
        if self.disk_cache_dir:
            size = "unbounded" if self.disk_cache_bytes is None else f"{self.disk_cache_bytes / 2**20:.1f} MiB"
            parts.append(f"disk tier {size} at {self.disk_cache_dir}")
        return ", ".join(parts)
