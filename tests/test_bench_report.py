"""The HTML report renders in headless Chromium with its plots (screenshot taken)."""

import base64
import re
import shutil
import subprocess

import matplotlib.image as mpimg
import numpy as np
import pytest

from flashlane.bench.runner import BenchConfig, run_bench

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome",
                  "headless_shell", "chromium-headless-shell")


def chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def headless(binary, *args, timeout=120):
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep_dir(fake_server_session, tmp_path_factory):
    fake_server_session.reset()
    out = tmp_path_factory.mktemp("report") / "sweep"
    cfg = BenchConfig(base_url=fake_server_session.url, output_dir=str(out), workload="agentic",
                      scale="small", concurrency=[1, 2], num_sessions=2, think_scale=0.5,
                      progress=False, seed=1, n_boot=100)
    run_bench(cfg)
    return out


def embedded_pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def test_report_images_are_valid_pngs(sweep_dir):
    for page, n in ((sweep_dir / "report.html", 2), (sweep_dir / "c1" / "report.html", 2)):
        pngs = embedded_pngs(page.read_text())
        assert len(pngs) == n
        for png in pngs:
            assert png[:8] == b"\x89PNG\r\n\x1a\n"
            import io
            img = mpimg.imread(io.BytesIO(png), format="png")
            assert img.shape[0] > 100 and img.shape[1] > 300 and img.std() > 0.01
    md = (sweep_dir / "c1" / "report.md").read_text()
    assert "| tasks / hour |" in md and "| TTFT |" in md


def test_report_renders_in_headless_chromium(sweep_dir, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary (apt-get install -y chromium)")
    for page in (sweep_dir / "report.html", sweep_dir / "c2" / "report.html"):
        n_imgs = len(embedded_pngs(page.read_text()))
        # A copy with a probe that records how many images Chromium actually decoded.
        probe = tmp_path / f"probe-{page.parent.name}.html"
        probe.write_text(page.read_text().replace(
            "</body>", "<script>window.addEventListener('load', () => document.body.setAttribute("
                       "'data-decoded', [...document.images].filter(i => i.complete && i.naturalWidth > 0)"
                       ".length));</script></body>"))
        r = headless(binary, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
        assert r.returncode == 0, r.stderr[-2000:]
        assert f'data-decoded="{n_imgs}"' in r.stdout
        shot = tmp_path / f"shot-{page.parent.name}.png"
        r = headless(binary, "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri())
        assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
        img = mpimg.imread(str(shot))
        assert img.shape[:2] == (2400, 1280)
        rgb = (img[..., :3] * 255).astype(int)
        # matplotlib's default first line colour (#1f77b4) only appears inside the plots (how many
        # pixels depends on the measured curves; a page without plots has none)
        blue = np.all(np.abs(rgb - np.array([0x1F, 0x77, 0xB4])) <= 12, axis=-1).sum()
        assert blue > 50
