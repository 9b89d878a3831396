"""`analyze` on every hardware profile it knows, with and without a price: the report, the
claims, the table and the CLI give a $ per task when there is a price and "n/a" when there is none."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flashlane.analyze import Options, Setup, build_report, load_task, render_text, resolve_model
from flashlane.analyze import hardware as hw_mod
from flashlane.analyze.hardware import HARDWARE, Hardware, get_hardware, hardware_names
from flashlane.cli.main import main

FLASH, STD = "glm-5.3-flash", "glm-5.3"
NAMES = hardware_names()
PRICE = 2.0
# what `local` calibrates to in these tests: no numpy timing, a fixed machine without a price
FIXED_LOCAL = Hardware("fixed test machine", {"bf16": 2e12, "fp8": 2e12, "int8": 2e12}, 5e10, 64e9, None,
                       "fixed profile for tests")


@pytest.fixture(autouse=True)
def fixed_local(monkeypatch):
    calls = []

    def fake(seconds: float = 0.5) -> Hardware:
        calls.append(seconds)
        return FIXED_LOCAL

    monkeypatch.setattr(hw_mod, "measure_local", fake)
    return calls


@pytest.fixture(scope="module")
def models():
    return [resolve_model(FLASH), resolve_model(STD)]


def _cost_claim(report: dict) -> dict:
    return next(c for c in report["claims"] if c["claim"].startswith("cost per task"))


def _usd_rows(text: str) -> list[list[str]]:
    """The cells of the table's '$ per task' rows (label dropped)."""
    rows = []
    for line in text.splitlines():
        if line.strip().startswith("$ per task"):
            _, _, cells = line.partition("concurrency ")
            rows.append(cells.split()[1:])       # drop the "1" / "B" that ends the label
    return rows


def test_the_registry_is_the_named_profiles_plus_local():
    assert set(NAMES) == set(HARDWARE) | {"local"}
    assert all(h.usd_per_hour for h in HARDWARE.values())     # every named profile has a price


def test_local_is_the_calibration_and_has_no_price(fixed_local):
    assert get_hardware("local") is FIXED_LOCAL and fixed_local
    assert get_hardware("local", usd_per_hour=1.5).usd_per_hour == 1.5


@pytest.mark.parametrize("price", [None, PRICE], ids=["no-price", "priced"])
@pytest.mark.parametrize("name", NAMES)
def test_report_and_claims_on_every_profile(models, name, price):
    hw = replace(get_hardware(name), usd_per_hour=price)
    report = build_report(models, Setup(hw), load_task("agentic"), Options((8 * 1024, 128 * 1024), 32))
    tasks = [m["roofline"]["task"][k] for m in report["models"] for k in ("c1", "cB")]
    claim = _cost_claim(report)
    usd_def = next(d for d in claim["definitions"] if d["definition"].startswith("$ per task"))
    text = render_text(report)
    assert report["hardware"]["usd_per_hour"] == price
    assert len(_usd_rows(text)) == 2
    if price is None:
        assert all(t["usd_per_task"] is None for t in tasks)
        assert report["ratios"]["roofline"]["usd_per_task_c1"] is None
        assert usd_def["values"] == {"-": None} and not usd_def["reproduces"]
        assert f"no $ per task ({hw.name} has no price)" in claim["verdict"]
        assert all(row[:2] == ["n/a", "n/a"] for row in _usd_rows(text))
        assert "no price (no $ per task)" in text
    else:
        for t in tasks:
            assert t["usd_per_task"] == pytest.approx(t["gpu_hours_per_task"] * price)
        a, b = (m["roofline"]["task"]["c1"]["usd_per_task"] for m in report["models"])
        assert usd_def["values"]["-"] == pytest.approx(b / a)
        assert "cheaper at the same GPU count" in claim["verdict"]
        assert all(c.startswith("$") for row in _usd_rows(text) for c in row[:2])
        assert f"${price:.2f}/GPU-hour" in text


def _cli(capsys, name: str, *extra: str) -> str:
    rc = main(["analyze", FLASH, "--baseline", STD, "--hardware", name, *extra])
    out = capsys.readouterr().out
    assert rc == 0
    return out


@pytest.mark.parametrize("name", NAMES)
def test_cli_on_every_profile_without_a_price(capsys, monkeypatch, name):
    if name != "local":
        monkeypatch.setitem(HARDWARE, name, replace(HARDWARE[name], usd_per_hour=None))
    out = _cli(capsys, name)
    rows = _usd_rows(out)
    assert len(rows) == 2 and all(row[:2] == ["n/a", "n/a"] for row in rows)
    assert "has no price" in out
    if name == "local":
        assert FIXED_LOCAL.name in out        # the calibration was the patched one


@pytest.mark.parametrize("name", NAMES)
def test_cli_on_every_profile_with_a_price(capsys, name):
    # the named profiles' own price, and local priced by the flag
    extra = ("--usd-per-gpu-hour", str(PRICE)) if name == "local" else ()
    out = _cli(capsys, name, *extra)
    rows = _usd_rows(out)
    assert len(rows) == 2 and all(c.startswith("$") for row in rows for c in row[:2])
    assert "has no price" not in out and "cheaper at the same GPU count" in out


def test_a_stored_profile_keeps_no_price():
    back = Hardware.from_dict(FIXED_LOCAL.to_dict())
    assert back == FIXED_LOCAL and back.usd_per_hour is None
    legacy = {k: v for k, v in FIXED_LOCAL.to_dict().items() if k != "usd_per_hour"}
    assert Hardware.from_dict(legacy).usd_per_hour is None
    assert Hardware.from_dict({**legacy, "usd_per_hour": "3"}).usd_per_hour == 3.0


# ---- the shipped profile files ----------------------------------------------------------------
def test_every_shipped_profile_sources_its_numbers_and_has_gpu_costs():
    from flashlane.analyze.hardware import PROFILE_DIR

    assert {"h100", "h200", "b200"} <= set(HARDWARE)
    assert sorted(p.stem for p in PROFILE_DIR.glob("*.json")) == sorted(HARDWARE)
    for name, hw in HARDWARE.items():
        assert hw.interconnect_bw > 0 and 0 < hw.graph_replay_s < hw.kernel_launch_s < 1e-4, name
        assert set(hw.efficiency) == {"mfu", "mbu"} and all(0 < v <= 1 for v in hw.efficiency.values()), name
        for key in ("peak_flops", "mem_bw", "mem_bytes", "interconnect_bw", "kernel_launch_s", "graph_replay_s",
                    "efficiency"):
            assert len(hw.sources[key]) > 20, (name, key)
    assert HARDWARE["h200"].peak("bf16") == HARDWARE["h100"].peak("bf16")   # same compute, more HBM
    assert HARDWARE["h200"].mem_bw > HARDWARE["h100"].mem_bw


def test_a_profile_file_with_an_unknown_or_unsourced_field_is_refused(tmp_path):
    import json

    from flashlane.analyze.hardware import PROFILE_DIR, load_profile

    good = json.loads((PROFILE_DIR / "h200.json").read_text())
    p = tmp_path / "x.json"
    p.write_text(json.dumps({**good, "nvlink": 1.0}))
    with pytest.raises(ValueError, match="unknown field.*nvlink"):
        load_profile(p)
    p.write_text(json.dumps({**good, "sources": {k: v for k, v in good["sources"].items() if k != "mem_bw"}}))
    with pytest.raises(ValueError, match="no source given for mem_bw"):
        load_profile(p)
    p.write_text(json.dumps({**good, "efficiency": {"mfu": 0.5, "speedup": 2}}))
    with pytest.raises(ValueError, match="unknown factor.*speedup"):
        load_profile(p)
    p.write_text(json.dumps({k: v for k, v in good.items() if k != "mem_bw"}))
    with pytest.raises(ValueError, match="mem_bw"):
        load_profile(p)
    # a stored profile (compare's hardware_local.json) round-trips with the new fields
    hw = load_profile(PROFILE_DIR / "b200.json")
    assert type(hw).from_dict(hw.to_dict()) == hw
