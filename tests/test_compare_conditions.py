"""Equal serving conditions in `flashlane compare`: what servers report (dtype, threads,
quantisation, KV dtype), where two differ, the one meaning of dtype "auto", and compare starting
both servers with the dtype and thread count it resolved once."""

import json
import os

import pytest
import torch

import flashlane.bench.compare as bench_compare
from flashlane.bench.conditions import mismatches, server_conditions
from flashlane.bench.server_launch import ServerProcess
from flashlane.cli.compare import equal_conditions
from flashlane.cli.main import main
from flashlane.engine import threads
from flashlane.kernels.cpu_caps import CpuCaps, choose_cpu_dtype
from flashlane.models.loader import AUTO_DTYPE_ENV

AMX = CpuCaps("AMX", frozenset({"amx_bf16", "amx_int8"}))


def models_doc(**report) -> dict:
    return {"object": "list", "data": [{"id": "m", "object": "model", "flashlane": report}]}


# ---- what a server reports ---------------------------------------------------------------------

def test_conditions_are_read_from_the_flashlane_card():
    doc = models_doc(dtype="bfloat16", num_threads=4, quantization=None, kv_cache_dtype="int8", arch="x",
                     linear_kernel={"format": "onednn", "why": "timed", "linears": 9, "extra_bytes": 0})
    assert server_conditions(doc) == {"dtype": "bfloat16", "num_threads": 4, "quantization": "none",
                                      "kv_cache_dtype": "int8", "linear_kernel": "onednn"}
    int8 = {"method": "int8", "linears": 12, "experts": 8, "expert_layers": 2, "head": True, "embeddings": 0}
    assert server_conditions(models_doc(quantization=int8))["quantization"] == "int8 (linears, experts, head)"
    assert server_conditions(models_doc(quantization="gguf Q4_1"))["quantization"] == "gguf Q4_1"
    nested = {"wrapper": {"cards": [{"id": "m"}, {"meta": {"flashlane": {"dtype": "float32"}}}]}}
    assert server_conditions(nested)["dtype"] == "float32"


def test_conditions_a_server_does_not_report_are_none():
    unknown = dict.fromkeys(("dtype", "num_threads", "quantization", "kv_cache_dtype", "linear_kernel"))
    assert server_conditions(None) == unknown
    assert server_conditions({"data": [{"id": "vllm-model", "owned_by": "vllm"}]}) == unknown
    # an older flashlane card without num_threads: only that one is unknown
    old = server_conditions(models_doc(dtype="float32", quantization=None, kv_cache_dtype="float32"))
    assert old == {"dtype": "float32", "num_threads": None, "quantization": "none", "kv_cache_dtype": "float32",
                   "linear_kernel": None}


def test_each_later_stack_is_checked_for_equal_sides_and_named_where_it_ran_otherwise():
    """compare's conditions line reads the first stack's servers; a later stack (static graphs run
    their own linears) is named where it ran otherwise, and its two sides are checked for
    equality on their own."""
    from flashlane.bench.compare_report import later_stack_conditions

    def conds(linears, threads=1):
        return server_conditions(models_doc(dtype="float32", num_threads=threads, quantization=None,
                                            kv_cache_dtype="float32", linear_kernel={"format": linears}))
    first = ("naive", {"flash": conds("native"), "standard": conds("native")})
    static = ("flashlane", {"flash": conds("aten"), "standard": conds("aten")})
    lines, unequal = later_stack_conditions([first, static])
    assert lines == ["the flashlane stack ran otherwise: flash: linear_kernel aten (first stack: native); "
                     "standard: linear_kernel aten (first stack: native)"]
    assert unequal == []
    lopsided = ("flashlane", {"flash": conds("aten"), "standard": conds("native", threads=2)})
    lines, unequal = later_stack_conditions([first, first, lopsided])
    assert unequal == ["flashlane: num_threads 1 vs 2", "flashlane: linear_kernel aten vs native"]
    assert len(lines) == 1 and "standard: num_threads 2 (first stack: 1)" in lines[0]
    assert later_stack_conditions([first]) == ([], []) and later_stack_conditions([]) == ([], [])


def test_mismatches_name_each_field_both_report_differently():
    a = server_conditions(models_doc(dtype="bfloat16", num_threads=1, quantization=None, kv_cache_dtype="bfloat16"))
    b = server_conditions(models_doc(dtype="float32", num_threads=1, quantization=None, kv_cache_dtype="float32"))
    assert mismatches(a, b) == ["dtype bfloat16 vs float32", "kv_cache_dtype bfloat16 vs float32"]
    assert mismatches(a, a) == []
    vllm = server_conditions({"data": [{"id": "x"}]})
    assert mismatches(a, vllm) == [] and mismatches(vllm, a) == []
    partial = {**b, "num_threads": None, "dtype": "bfloat16"}
    assert mismatches(a, partial) == ["kv_cache_dtype bfloat16 vs float32"]
    packed = server_conditions(models_doc(dtype="bfloat16", num_threads=1, quantization=None,
                                          kv_cache_dtype="bfloat16", linear_kernel={"format": "onednn"}))
    loaded = {**packed, "linear_kernel": "aten"}
    assert mismatches(packed, loaded) == ["linear_kernel onednn vs aten"]


# ---- dtype "auto" says which condition failed --------------------------------------------------

def fake_timer(bf16_share: dict[int, float]):
    """float32 takes 1 s at every row count, bfloat16 `bf16_share[rows]` s."""
    return lambda dtype, rows: bf16_share[rows] if dtype == torch.bfloat16 else 1.0


def test_auto_dtype_why_names_the_row_count_where_bf16_lost():
    lost_decode = choose_cpu_dtype(AMX, fake_timer({1: 1.6, 64: 0.1}))
    assert lost_decode.dtype == "float32"
    assert lost_decode.why.endswith("-> bf16 short of no slower at 1 row")
    assert "1 row fp32 1000.00ms bf16 1600.00ms, 64 rows fp32 1000.00ms bf16 100.00ms" in lost_decode.why
    # a prefill win no noise hides, decode a little slower (a 1-row timing that flips run to run)
    clear = choose_cpu_dtype(AMX, fake_timer({1: 1.05, 64: 0.3}))
    assert clear.dtype == "bfloat16" and clear.why.endswith("-> bf16 >=2x faster at 64 rows, decode within 1.5x")
    assert choose_cpu_dtype(AMX, fake_timer({1: 1.05, 64: 0.6})).dtype == "float32"    # prefill win not clear
    lost_both = choose_cpu_dtype(AMX, fake_timer({1: 1.2, 64: 0.95}))
    assert lost_both.dtype == "float32"
    assert lost_both.why.endswith("bf16 short of no slower at 1 row, >=10% faster at 64 rows")
    # decode only has to be no slower (a 1-row bf16 GEMV is not much faster on CPUs); prefill 10% faster
    won = choose_cpu_dtype(AMX, fake_timer({1: 0.95, 64: 0.9}))
    assert won.dtype == "bfloat16" and won.why.endswith("-> bf16 no slower at 1 row, >=10% faster at 64 rows")


# ---- compare resolves dtype and threads once ---------------------------------------------------

@pytest.fixture
def machine(monkeypatch):
    """A 4-CPU machine with one core busy, and this (test) process's torch at 1 thread: a fresh
    server would take 4 - 1 busy - 1 reserved = 2."""
    monkeypatch.setattr(threads, "usable_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(threads, "busy_cpus", lambda cpus: 1.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    monkeypatch.setenv("FLASHLANE_LINEAR_KERNEL", "aten")
    assert torch.get_num_threads() == 1   # conftest


def test_compare_resolves_what_a_fresh_server_would_pick(machine):
    lines = []
    extra, cond = equal_conditions(["--max-num-seqs", "4"], lines.append)
    assert extra == ["--dtype", "bfloat16", "--num-threads", "2", "--linear-kernel", "aten"]
    assert cond == {"dtype": "bfloat16", "dtype_reason": f"pinned by {AUTO_DTYPE_ENV}", "num_threads": 2,
                    "linear_kernel": "aten", "linear_kernel_reason": "pinned by FLASHLANE_LINEAR_KERNEL",
                    "source": "resolved once by compare"}
    assert lines == [f"both servers: dtype bfloat16 (auto: pinned by {AUTO_DTYPE_ENV}), 2 threads, linears aten"]
    assert torch.get_num_threads() == 1   # the dtype timing leaves this process's threads as they were


def test_compare_resolves_threads_from_omp_num_threads_like_a_server(machine, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert equal_conditions([], lambda m: None)[0] == ["--dtype", "bfloat16", "--num-threads", "3",
                                                       "--linear-kernel", "aten"]


def test_values_given_with_serve_arg_pass_through(machine):
    assert equal_conditions(["--dtype", "float32", "--num-threads=1", "--linear-kernel", "onednn"],
                            lambda m: None) == (
        [], {"dtype": "float32", "dtype_reason": "given with --serve-arg", "num_threads": 1,
             "linear_kernel": "onednn", "linear_kernel_reason": "given with --serve-arg",
             "source": "given with --serve-arg"})
    extra, cond = equal_conditions(["--dtype=float32"], lambda m: None)
    assert extra == ["--num-threads", "2", "--linear-kernel", "aten"] and cond["dtype"] == "float32"
    assert cond["num_threads"] == 2 and cond["linear_kernel"] == "aten"
    # an explicit auto is resolved here, to the same meaning, so both servers still agree
    assert equal_conditions(["--dtype", "auto", "--num-threads", "1", "--linear-kernel=aten"],
                            lambda m: None)[0] == ["--dtype", "bfloat16"]
    assert equal_conditions(["--dtype", "float32", "--num-threads", "1", "--linear-kernel", "auto"],
                            lambda m: None)[0] == ["--linear-kernel", "aten"]


def capture_run_compare(monkeypatch) -> dict:
    seen = {}

    def fake(a, b, cfg, out, template=None, extra_args=None, conditions=None, **kw):
        seen.update(template=template, extra_args=list(extra_args), conditions=conditions)
        return {"markdown": "", "tasks_measured": 0}

    monkeypatch.setattr(bench_compare, "run_compare", fake)
    return seen


COMPARE_CHEAP = ["--scale", "small", "--concurrency", "1", "--stacks", "flashlane", "--no-predict",
                 "--num-sessions", "1", "--no-progress", "--no-record"]


def test_compare_cli_passes_the_resolved_conditions_only_to_servers_it_starts(machine, monkeypatch, tmp_path):
    seen = capture_run_compare(monkeypatch)
    out = ["--output-dir", str(tmp_path / "o")]
    assert main(["compare", "tiny-flash", "tiny-standard", *COMPARE_CHEAP, *out,
                 "--serve-arg=--max-num-seqs", "--serve-arg=4"]) == 0
    assert seen["extra_args"] == ["--max-num-seqs", "4", "--dtype", "bfloat16", "--num-threads", "2",
                                  "--linear-kernel", "aten"]
    assert seen["conditions"]["dtype"] == "bfloat16" and seen["conditions"]["num_threads"] == 2
    # a user's own server command or URLs: their servers, their conditions
    assert main(["compare", "tiny-flash", "tiny-standard", *COMPARE_CHEAP, *out,
                 "--serve-command", "{python} -m my_server --port {port}"]) == 0
    assert seen["extra_args"] == [] and seen["conditions"] is None
    assert main(["compare", "http://127.0.0.1:1", "http://127.0.0.1:2", *COMPARE_CHEAP, *out]) == 0
    assert seen["extra_args"] == [] and seen["conditions"] is None


def test_a_pair_whose_servers_would_pick_different_dtypes_no_longer_does(monkeypatch, tmp_path):
    """Each server's own dtype "auto" is pinned differently (as two start-up timings could come
    out); compare's one resolution makes both run the same dtype and thread count."""
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")   # what compare itself resolves
    own_pick = {"tiny-flash": "bfloat16", "tiny-standard": "float32"}
    launched = {}
    start = ServerProcess.start

    def start_with_own_pick(self):
        model = self.command[self.command.index("--model") + 1]
        launched[model] = list(self.command)
        before = os.environ[AUTO_DTYPE_ENV]
        os.environ[AUTO_DTYPE_ENV] = own_pick[model]   # the environment this server inherits
        try:
            return start(self)
        finally:
            os.environ[AUTO_DTYPE_ENV] = before

    monkeypatch.setattr(ServerProcess, "start", start_with_own_pick)
    out = tmp_path / "cmp"
    assert main(["compare", "tiny-flash", "tiny-standard", *COMPARE_CHEAP, "--output-dir", str(out)]) == 0

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1] if name in cmd else None

    reported = {}
    for manifest in out.rglob("manifest.json"):
        m = json.loads(manifest.read_text())
        reported[m["model"]] = server_conditions(m["server_models"])
    assert set(reported) == set(launched) == set(own_pick)
    a, b = reported["tiny-flash"], reported["tiny-standard"]
    assert mismatches(a, b) == []
    assert a["dtype"] == b["dtype"] == "float32"
    assert a["quantization"] == b["quantization"] == "none"
    cmds = list(launched.values())
    assert flag(cmds[0], "--dtype") == flag(cmds[1], "--dtype") == "float32"
    assert flag(cmds[0], "--num-threads") == flag(cmds[1], "--num-threads") is not None
    assert a["num_threads"] == b["num_threads"] == int(flag(cmds[0], "--num-threads"))
