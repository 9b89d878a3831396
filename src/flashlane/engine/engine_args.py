"""Engine arguments shared by the offline LLM, the server and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, fields


def check_sizes(sizes) -> tuple[int, ...]:
    """Validated, sorted, de-duplicated bucket sizes (ValueError naming ``compile_sizes``)."""
    items = list(sizes) if isinstance(sizes, (list, tuple)) else None
    if not items or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in items):
        raise ValueError(f"compile_sizes must be a non-empty list of integer batch sizes >= 1, got {sizes!r}")
    return tuple(sorted(set(items)))


@dataclass
class EngineArgs:
    dtype: str = "auto"                  # auto | float32 | bfloat16
    device: str = "cpu"
    seed: int = 0
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cache_memory: float | int = 512 * 1024 * 1024   # bytes, or a fraction (<= 1.0) of free memory
    num_pages: int | None = None         # override the budget split (tests, tuning)
    num_slots: int | None = None
    max_wait_ms: float = 0.0             # dynamic batching window; 0 = off
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    num_threads: int | None = None       # torch intra-op threads (CPU)
    compile: bool = False                # static-graph decode (torch.compile per batch bucket) + compiled mHC
    compile_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)   # decode batch buckets compiled (compile=True)
    quantization: str | None = None      # int8 (weight-only) | w8a8 (+ dynamic int8 activations) | gguf (the
                                         # .gguf file's Q4_1/Q8_0 blocks kept); in place
    kv_cache_dtype: str = "auto"         # latent/KV + index-key pools: auto (model dtype) | bfloat16 | int8
    index_topk: int | None = None        # sparse-attention selection size, overriding the config's
    skip_tokenizer_init: bool = False    # no tokenizer: prompts and outputs are token ids (text stays empty)
    enable_prefix_caching: bool = True   # share full pages by content; state checkpoints for hybrids
    checkpoint_share: float = 0.1        # share of cache_memory for state checkpoints (stateful models)
    num_checkpoints: int | None = None   # override the checkpoint pool size (tests)
    host_cache_memory: int = 0           # bytes of host memory for pages/checkpoints evicted from the pool
    disk_cache_dir: str | None = None    # directory of the disk tier (survives restarts); None = off
    disk_cache_bytes: int | None = None  # byte budget of the disk tier (None = unbounded)
    disk_load_timeout_s: float = 5.0     # a disk-tier load in flight longer is given up (recomputed)
    scheduler: str = "continuous"        # continuous | static (fixed batches run to completion)
    static_batch_size: int = 32          # static: requests per batch, taken in arrival order
    step_log_size: int = 100_000         # engine step records kept (ring buffer; /debug/steps)
    kernel_backend: str = "auto"         # kernels the model ops run on: auto (chosen for the device) | a name
    linear_kernel: str = "auto"          # float linears' format: auto (timed at start-up) | aten | onednn | native
    speculative_config: dict | str | None = None   # {"method": "ngram", "num_speculative_tokens": k, ...}; None = off

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return cls(**kwargs)

    def validate(self) -> None:
        if self.scheduler not in ("continuous", "static"):
            raise ValueError(f"scheduler must be 'continuous' or 'static', got {self.scheduler!r}")
        for name in ("static_batch_size", "step_log_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.scheduler == "static" and self.max_wait_ms:
            raise ValueError("max_wait_ms (the dynamic batching window) is a continuous-scheduler option; "
                             "scheduler='static' forms each batch from what is waiting when the last one ends")
        self.compile_sizes = check_sizes(self.compile_sizes)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.quantization not in (None, "int8", "w8a8", "gguf"):
            raise ValueError(f"quantization must be None, 'int8', 'w8a8' or 'gguf', got {self.quantization!r}")
        if self.quantization == "gguf" and self.compile:
            raise ValueError("quantization 'gguf' runs native block kernels, which static graphs (compile=True) "
                             "cannot trace; choose one of the two")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16 or int8, got {self.kv_cache_dtype!r}")
        if self.index_topk is not None and (isinstance(self.index_topk, bool) or not isinstance(self.index_topk, int)
                                            or self.index_topk < 1):
            raise ValueError(f"index_topk must be an integer >= 1 (or None for the config's), got {self.index_topk!r}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        share = self.checkpoint_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"checkpoint_share must be a number in (0, 1], got {share!r}")
        for name in ("host_cache_memory", "disk_cache_bytes", "num_checkpoints"):
            v = getattr(self, name)
            if v is None and name != "host_cache_memory":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (name == "disk_cache_bytes" and v == 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'disk_cache_bytes' else 'non-negative'} "
                                 f"integer number of {'entries' if name == 'num_checkpoints' else 'bytes'}, "
                                 f"got {v!r}")
        t = self.disk_load_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"disk_load_timeout_s must be a finite number of seconds > 0, got {t!r}")
        if (self.disk_cache_bytes is not None) and not self.disk_cache_dir:
            raise ValueError("disk_cache_bytes needs disk_cache_dir")
        if (self.host_cache_memory or self.disk_cache_dir) and not self.enable_prefix_caching:
            raise ValueError("host_cache_memory / disk_cache_dir are tiers of the prefix cache: "
                             "they need enable_prefix_caching")
        self._check_kernel_backend()
        from ..kernels.linear_plan import CHOICES as linear_kernels

        if self.linear_kernel not in linear_kernels:
            raise ValueError(f"linear_kernel must be one of {', '.join(map(repr, linear_kernels))}, "
                             f"got {self.linear_kernel!r}")
        self.speculative()      # ValueError naming the speculative_config field

    def speculative(self):
        """The parsed ``speculative_config`` (None: speculative decoding off)."""
        from .speculative import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    def _check_kernel_backend(self) -> None:
        from ..kernels.backends import select_backend   # torch and the kernels: only when validating

        if not isinstance(self.kernel_backend, str):
            raise ValueError(f"kernel_backend must be 'auto' or a backend name, got {self.kernel_backend!r}")
        select_backend(self.device, self.kernel_backend)   # ValueError naming kernel_backend and the known ones
