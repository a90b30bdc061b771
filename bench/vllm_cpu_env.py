"""The environment of bench_vllm_cpu.py's two systems: the CPU and its ISA flags, the libraries
vLLM's CPU docs ask to preload (tcmalloc, Intel's libiomp5) found in its venv or on the system,
each side's environment variables (with ``--isa avx2`` both capped at AVX2), the versions each
side runs, and the optional torch extras of the vLLM venv that fail to import there (hidden from
vLLM's processes)."""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info() -> tuple[str, list[str]]:
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == (platform.processor() or "unknown CPU"):
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, [f for f in ISA_FLAGS if f in flags]


def _ldconfig_libs() -> dict[str, str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    libs = {}
    for line in out.splitlines():
        match = re.match(r"\s*(\S+) \([^)]*\) => (\S+)", line)
        if match:
            libs.setdefault(match.group(1), match.group(2))
    return libs


def find_library(venv: Path, names: tuple[str, ...]) -> Optional[str]:
    """The first file matching one of ``names`` (glob patterns) in the venv, then the linker's
    cache, then the usual library folders."""
    folders = [venv / "lib", *sorted(venv.glob("lib/python*/site-packages/vllm/libs"))]
    for folder in folders:
        for pattern in names:
            hits = sorted(glob.glob(str(folder / pattern)))
            if hits:
                return hits[0]
    cached = _ldconfig_libs()
    for pattern in names:
        for soname, path in sorted(cached.items()):
            if re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), soname):
                return path
    for folder in (f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        for pattern in names:
            hits = sorted(glob.glob(os.path.join(folder, pattern)))
            if hits:
                return hits[0]
    return None


_OPTIONAL_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_PROBE = ("import importlib, json\nbad = []\nfor name in %r:\n    try:\n        importlib.import_module(name)\n"
          "    except ModuleNotFoundError:\n        pass\n    except Exception:\n        bad.append(name)\n"
          "print(json.dumps(bad))") % (_OPTIONAL_EXTRAS,)


def broken_extras(args) -> list[str]:
    """Probes the vLLM venv's torchvision/torchaudio/torchcodec: the names of those installed but
    failing to import (e.g. the CUDA wheel from PyPI beside a +cpu torch: pip without PyTorch's
    CPU index). A text model needs none of them."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run([args.vllm_python, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env)
    bad = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []
    if bad:
        print(f"warning: {', '.join(bad)} cannot be imported in the vLLM venv (a build for another torch?); "
              "hidden from vLLM's processes", file=sys.stderr)
    return bad


# torch.cpu's probes that vLLM asks to pick its kernels (its _C_AVX2 / _C_AVX512 / _C build,
# the attention and GEMM paths).
_WIDE_ISA_PROBES = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                    "_is_amx_tile_supported", "_is_amx_fp16_supported")


def write_vllm_shim(args, work_dir: Path, hidden: list[str]) -> None:
    """A ``sitecustomize`` on every vLLM process's PYTHONPATH, when needed: the broken extras
    hidden (transformers then sees them as absent), and with ``--isa avx2`` torch.cpu's AVX-512
    and AMX probes answering False, so that vLLM loads its AVX2 kernels as on an AVX2-only CPU
    (vllm_env caps oneDNN and torch's own kernels beside it)."""
    lines = []
    if hidden:
        lines += ["import sys", f"for _name in {tuple(hidden)!r}:", "    sys.modules[_name] = None"]
    if args.isa == "avx2":
        lines += ["import torch", f"for _probe in {_WIDE_ISA_PROBES!r}:",
                  "    if hasattr(torch.cpu, _probe):", "        setattr(torch.cpu, _probe, lambda: False)"]
    if lines:
        shim = work_dir / "vllm-shim"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text("# Written by bench/bench_vllm_cpu.py (vllm_cpu_env.py).\n"
                                               + "\n".join(lines) + "\n")
        args.vllm_shim = str(shim)


def vllm_env(args) -> dict[str, str]:
    venv = Path(os.path.abspath(args.vllm_python)).parent.parent  # not resolved: a venv's python is a link
    tcmalloc = find_library(venv, ("libtcmalloc_minimal.so*", "libtcmalloc.so*"))
    iomp = find_library(venv, ("libiomp5.so",))
    preload = [p for p in (tcmalloc, iomp) if p]
    if len(preload) < 2:
        print(f"warning: LD_PRELOAD lacks {'tcmalloc' if not tcmalloc else 'libiomp5'}; "
              "vLLM will run slower than its docs intend", file=sys.stderr)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
               VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind or f"0-{args.threads - 1}",
               VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if args.isa == "avx2":  # oneDNN's matmuls, torch's ops and inductor's generated code
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    env["LD_PRELOAD"] = ":".join(preload + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p])
    env.pop("PYTHONPATH", None)
    if getattr(args, "vllm_shim", None):
        env["PYTHONPATH"] = args.vllm_shim
    env.update(_pairs(args.vllm_env))
    return env


def vpage_env(args) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args.isa == "avx2":
        env["VPAGE_CPU_ISA"] = "avx2"
    env.update(_pairs(args.vpage_env))
    return env


def _pairs(items: Optional[list[str]]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items or [])


def versions(args, env: dict[str, str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\n"
            "def v(*names):\n"
            "    for n in names:\n"
            "        try:\n"
            "            return m.version(n)\n"
            "        except m.PackageNotFoundError:\n"
            "            pass\n"
            "print(json.dumps({'vllm': v('vllm-cpu', 'vllm'), 'torch': v('torch')}))")
    try:
        out = subprocess.run([args.vllm_python, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        peer = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        peer = {}
    import torch

    import vpage
    from vpage import _core

    return {"vllm": peer.get("vllm", "?"), "vllm_torch": peer.get("torch", "?"), "vpage": vpage.__version__,
            "vpage_torch": torch.__version__, "vpage_isa": args.isa if args.isa != "native" else _core.cpu_isa()}
