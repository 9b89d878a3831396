"""Stack files (bench/stack_files.py): the format, its errors naming file and field, the built-ins
as files, `compare --stacks-file`, and an external-command stack run against the fake server."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import tomllib
from bench_fixtures import run_cli

from flashlane.bench.compare import (
    CompareTarget,
    external_notes,
    launch_command,
    stack_command,
)
from flashlane.bench.compare_runs import StackRun
from flashlane.bench.stack_files import Mechanisms, load_stack_paths, parse_stack
from flashlane.bench.stacks import BUILTIN_DIR, DEFAULT_STACKS, STACKS, parse_stacks
from flashlane.cli import compare as compare_cli

ROOT = Path(__file__).resolve().parent.parent

MECH = """prefix_cache = true
prefix_cache_stateful = false
batching = "continuous"
static_graphs = false
"""


def stack_text(name="s", hybrid_cmd="flashlane serve --max-wait-ms 2", standard_cmd="flashlane serve",
               hybrid_mech=MECH, extra="", standard=True) -> str:
    text = (f'name = "{name}"\ndescription = "a test stack"\n{extra}\n'
            f'[hybrid]\ncommand = "{hybrid_cmd}"\n[hybrid.mechanisms]\n{hybrid_mech}\n')
    if standard:
        text += f'[standard]\ncommand = "{standard_cmd}"\n[standard.mechanisms]\n{MECH}\n'
    return text


def test_builtin_files_give_exactly_the_former_hard_coded_flags():
    # the flag sets the three stacks had as Python tuples before they became files (flashlane's
    # has static-graph decode since)
    naive = ["--scheduler", "static", "--static-batch-size", "32", "--no-enable-prefix-caching"]
    former = {"naive": (naive, naive),
              "hybrid-cache-gap": (["--no-enable-prefix-caching"], ["--enable-prefix-caching"]),
              "flashlane": (["--enable-prefix-caching", "--max-wait-ms", "2", "--compile"],) * 2}
    assert list(STACKS)[:3] == list(DEFAULT_STACKS) == list(former)
    assert list(STACKS)[3:] == ["flashlane-mtp"]      # built in, not in the default three
    for name, (hybrid, standard) in former.items():
        s = STACKS[name]
        assert (s.flags("hybrid"), s.flags("standard")) == (hybrid, standard), name
        assert not s.external("hybrid") and not s.external("standard")
        assert s.hybrid.env == s.standard.env == () and s.mechanism and Path(s.source).parent == BUILTIN_DIR
    n, gap, fl = (STACKS[k] for k in DEFAULT_STACKS)
    assert n.hybrid.mechanisms.batching == "static" and n.hybrid.mechanisms.static_batch_size == 32
    assert not gap.hybrid.mechanisms.prefix_cache and gap.standard.mechanisms.prefix_cache
    assert fl.hybrid.mechanisms.prefix_cache_stateful and fl.hybrid.mechanisms.batching_window_ms == 2.0
    assert fl.hybrid.mechanisms.static_graphs and fl.standard.mechanisms.static_graphs
    assert not any(s.hybrid.mechanisms.static_graphs for s in (n, gap))


def test_the_mtp_stack_gives_json_flags_and_its_mechanism():
    from flashlane.bench.stack_files import fill
    from flashlane.cli.engine_flags import engine_kwargs_of_flags

    s = STACKS["flashlane-mtp"]
    for role in ("hybrid", "standard"):
        flags = s.flags(role)       # the file's {{ }} are literal braces: JSON, not placeholders
        assert engine_kwargs_of_flags(flags)["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
        assert [fill(f, {"model": "m", "port": 1}) for f in flags] == flags
        m = s.role(role).mechanisms
        assert (m.speculative_method, m.num_speculative_tokens) == ("mtp", 3)
    assert fill("--x={model}:{port}", {"model": "m", "port": 8}) == "--x=m:8"
    with pytest.raises(ValueError, match="speculative_method and num_speculative_tokens"):
        Mechanisms(prefix_cache=True, prefix_cache_stateful=True, batching="continuous", static_graphs=False,
                   num_speculative_tokens=2)


def test_builtin_files_are_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "bench/stacks/*.toml" in cfg["tool"]["setuptools"]["package-data"]["flashlane"]
    assert BUILTIN_DIR == ROOT / "src" / "flashlane" / "bench" / "stacks"


def test_a_built_in_stack_command_is_the_same_serve_command_as_before():
    t = CompareTarget("tiny-flash", "tiny-flash", model="tiny-flash", role="hybrid")
    extra = ["--dtype", "bf16", "--num-threads", "2"]
    for name in DEFAULT_STACKS:
        assert stack_command(t, 8000, STACKS[name], None, extra) == \
            launch_command(t, 8000, None, extra, STACKS[name].flags("hybrid"))


@pytest.mark.parametrize("text, field", [
    (stack_text(hybrid_mech=MECH + "speculative = true\n"),
     "hybrid.mechanisms.speculative: unknown mechanism 'speculative'; known: prefix_cache"),
    (stack_text(hybrid_cmd="vllm serve {model} --port {port} --gpus {gpus}"),
     "hybrid.command: unknown placeholder {gpus}; known: {model}, {port}, {host}, {python}"),
    (stack_text(standard=False), "standard: missing (role)"),
    (stack_text(extra='flavour = "x"'), "flavour: unknown key 'flavour'; known: name, description"),
    (stack_text(hybrid_mech=MECH.replace('"continuous"', '"chunked"')), "hybrid.mechanisms.batching: Input should be"),
    (stack_text(hybrid_mech=MECH.replace("static_graphs = false\n", "")), "hybrid.mechanisms.static_graphs: missing"),
    (stack_text(hybrid_mech=MECH.replace("prefix_cache = true", "prefix_cache = false")
                .replace("stateful = false", "stateful = true")),
     "hybrid.mechanisms: prefix_cache_stateful needs prefix_cache = true"),
    (stack_text(hybrid_cmd="flashlane serve --port {port}"), "hybrid.command: --port is set by compare"),
    (stack_text(standard_cmd="vllm serve {model}"), "standard.command: an external server command must listen on {port}"),
    (stack_text(name="a b"), "name: String should match pattern"),
])
def test_an_invalid_stack_file_is_an_error_naming_file_and_field(text, field):
    with pytest.raises(ValueError) as e:
        parse_stack(text, "my/stack.toml")
    assert f"stack file my/stack.toml: {field}" in str(e.value)


def test_bad_toml_and_duplicate_names_name_their_files(tmp_path):
    (tmp_path / "broken.toml").write_text("name = ")
    with pytest.raises(ValueError, match=r"stack file .*broken.toml: not valid TOML"):
        load_stack_paths([tmp_path / "broken.toml"])
    (tmp_path / "a.toml").write_text(stack_text("same"))
    (tmp_path / "b.toml").write_text(stack_text("same"))
    with pytest.raises(ValueError, match=r"stack 'same' is defined twice: in .*a.toml and in .*b.toml"):
        load_stack_paths([tmp_path / "a.toml", tmp_path / "b.toml"])
    with pytest.raises(ValueError, match="cannot be read"):
        load_stack_paths([tmp_path / "missing.toml"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*.toml stack files in folder"):
        load_stack_paths([tmp_path / "empty"])


def test_stack_files_add_or_override_and_stacks_selects_by_name(tmp_path):
    (tmp_path / "2-mine.toml").write_text(stack_text("mine"))
    (tmp_path / "1-flashlane.toml").write_text(stack_text("flashlane", hybrid_cmd="flashlane serve --max-wait-ms 9"))
    files = load_stack_paths([tmp_path])  # a folder: its files by name
    assert list(files) == ["flashlane", "mine"]
    known = {**STACKS, **files}
    assert [s.name for s in parse_stacks(None, known, default=list(files))] == ["flashlane", "mine"]
    chosen = parse_stacks("naive,flashlane", known)
    assert chosen[0] is STACKS["naive"] and chosen[1].flags("hybrid") == ["--max-wait-ms", "9"]
    with pytest.raises(ValueError, match=r"unknown stack\(s\) 'theirs'; choose from naive, hybrid-cache-gap, flashlane, flashlane-mtp, mine"):
        parse_stacks("theirs", known)


def test_an_external_command_runs_as_written_with_its_env():
    text = stack_text("ext", hybrid_cmd="vllm serve {model} --host {host} --port {port} --enable-prefix-caching")
    s = parse_stack(text.replace("[hybrid.mechanisms]", 'env = { CUDA_VISIBLE_DEVICES = "0,1" }\n[hybrid.mechanisms]'))
    assert s.external("hybrid") and not s.external("standard")
    t = CompareTarget("m", "m", model="/models/GLM-5.3-Flash", role="hybrid")
    cmd = stack_command(t, 8123, s, "ignored {port}", ["--dtype", "bf16"])
    assert cmd == ["env", "CUDA_VISIBLE_DEVICES=0,1", "vllm", "serve", "/models/GLM-5.3-Flash", "--host",
                   "127.0.0.1", "--port", "8123", "--enable-prefix-caching"]
    assert s.flags("hybrid")[:2] == ["vllm", "serve"]  # shown in the report as the whole command
    a = CompareTarget("a", "a", model="a", role="hybrid")
    b = CompareTarget("b", "b", model="b", role="standard")
    notes = external_notes([a, b], [StackRun("ext", s), StackRun("flashlane", STACKS["flashlane"])])
    assert len(notes) == 1 and notes[0].startswith("ext runs a on an external server") and "unavailable" in notes[0]


def test_examples_are_valid_stack_files():
    found = load_stack_paths([ROOT / "examples" / "stacks"])
    assert {"vllm", "sglang"} <= set(found)
    for s in found.values():
        assert s.external("hybrid") and s.external("standard")
        assert s.standard.mechanisms.prefix_cache
        # the declared mechanism agrees with the command's flag
        assert s.hybrid.mechanisms.prefix_cache == ("--no-enable-prefix-caching" not in s.flags("hybrid"))


def test_stacks_file_option_is_repeatable():
    ap = argparse.ArgumentParser()
    compare_cli.add_parser(ap.add_subparsers())
    a = ap.parse_args(["compare", "--stacks-file", "x.toml", "--stacks-file", "dir/"])
    assert a.stacks_file == ["x.toml", "dir/"] and ap.parse_args(["compare"]).stacks_file == []


def test_compare_reports_an_invalid_stack_file(tmp_path):
    (tmp_path / "bad.toml").write_text(stack_text(hybrid_mech=MECH + "turbo = 1\n"))
    r = run_cli(["compare", "--stacks-file", str(tmp_path / "bad.toml"), "--no-progress"], timeout=120)
    assert r.returncode == 2
    assert f"flashlane compare: error: stack file {tmp_path / 'bad.toml'}: hybrid.mechanisms.turbo: unknown mechanism" in r.stderr


FAKE = f"{sys.executable} tests/bench_fake_server.py --port {{port}} --model {{model}}"


def test_an_external_stack_runs_end_to_end_on_wall_clock_figures(tmp_path):
    text = stack_text("fake-ext", hybrid_cmd=FAKE + " --token-delay 0.002", standard_cmd=FAKE)
    text = text.replace("[hybrid.mechanisms]", 'env = { FAKE_STACK_ROLE = "hybrid" }\n[hybrid.mechanisms]')
    (tmp_path / "fake.toml").write_text(text)
    out = tmp_path / "out"
    r = run_cli(["compare", "slow-model", "fast-model", "--stacks-file", str(tmp_path / "fake.toml"),
                 "--scale", "small", "--concurrency", "1", "--num-sessions", "1", "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every stack runs an external server; no simulation beside it, no profile" in r.stderr
    assert "both servers: dtype" not in r.stderr  # equal conditions are for `flashlane serve` only
    res = json.loads((out / "compare.json").read_text())
    assert [s["name"] for s in res["stacks"]] == ["fake-ext"]
    assert any("engine-side attributions" in line and "unavailable" in line for line in res["explanation"])
    for model, env in (("slow-model", ["env", "FAKE_STACK_ROLE=hybrid"]), ("fast-model", [])):
        run = out / "fake-ext" / model / "c1"
        cmd = json.loads((run / "manifest.json").read_text())["server_command"]
        assert cmd[:len(env) + 2] == env + [sys.executable, "tests/bench_fake_server.py"]
        assert "--dtype" not in cmd and json.loads((run / "summary.json").read_text())["errors"]["total"] == 0
        point = res["points"][f"fake-ext/{model}"][0]
        assert point["measured"]["tasks"] == 1 and point["attribution"] is None and point["simulated"] is None
