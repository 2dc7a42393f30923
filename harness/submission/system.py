"""The system description JSON, filled from the machine it runs on.

Accelerator facts come from `nvidia-smi` when it answers (name, memory, count); a machine without
one is described as a CPU-only system ("N/A" accelerator, 0 per node) so the file stays truthful.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _sockets() -> int:
    ids = {line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
           if line.startswith("physical id")}
    return max(1, len(ids))


def _mem_gib() -> str:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    return "unknown"


def _storage_type() -> str:
    """SSD/HDD of the block devices (from /sys/block/*/queue/rotational)."""
    kinds = set()
    for rot in Path("/sys/block").glob("*/queue/rotational"):
        if rot.parts[3].startswith(("loop", "ram", "zram")):
            continue
        kinds.add("HDD" if _read(str(rot)).strip() == "1" else "SSD")
    return " + ".join(sorted(kinds)) or "unknown (not detected)"


def _os_name() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return f"{platform.system()} {platform.release()}"


def accelerators() -> list[dict[str, str]]:
    """One dict per GPU from nvidia-smi (name, memory); [] when there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, mem = (p.strip() for p in line.split(",", 1))
        gpus.append({"name": name, "memory": mem})
    return gpus


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def software_versions() -> dict[str, str]:
    return {d: _version(d) for d in ("kiln", "torch", "triton", "nvidia-modelopt", "transformers",
                                     "nvidia-pytriton", "tritonclient", "mlcommons-loadgen", "numpy")}


def default_system_name() -> str:
    gpus = accelerators()
    if gpus:
        return f"{len(gpus)}x{gpus[0]['name'].replace('NVIDIA ', '').replace(' ', '_')}_kiln"
    return f"cpu{os.cpu_count()}c_kiln"


def describe(org: str, division: str, system_name: str, status: str = "available") -> dict:
    gpus = accelerators()
    sw = software_versions()
    disk = shutil.disk_usage("/")
    return {
        "submitter": org,
        "division": division,
        "system_type": "datacenter",
        "system_type_detail": "N/A",
        "status": status,
        "system_name": system_name,
        "number_of_nodes": 1,
        "host_processors_per_node": _sockets(),
        "host_processor_model_name": _cpu_model(),
        "host_processor_core_count": str(os.cpu_count()),
        "host_memory_capacity": _mem_gib(),
        "host_memory_configuration": "",
        "host_storage_type": _storage_type(),
        "host_storage_capacity": f"{disk.total / 2**30:.0f} GiB",
        "host_networking": "N/A (LoadGen and server on one host, loopback gRPC)",
        "host_networking_topology": "N/A",
        "host_network_card_count": "N/A",
        "accelerators_per_node": len(gpus),
        "accelerator_model_name": gpus[0]["name"] if gpus else "N/A (CPU only)",
        "accelerator_memory_capacity": gpus[0]["memory"] if gpus else "N/A",
        "accelerator_memory_configuration": "",
        "accelerator_host_interconnect": "",
        "accelerator_interconnect": "",
        "accelerator_frequency": "",
        "accelerator_on-chip_memories": "",
        "cooling": "",
        "hw_notes": "",
        "framework": (f"Kiln {sw['kiln']}, Triton Inference Server 2.51 (nvidia-pytriton {sw['nvidia-pytriton']}), "
                      f"PyTorch {sw['torch']}, OpenAI Triton {sw['triton']}"),
        "other_software_stack": (f"Python {platform.python_version()}, ModelOpt {sw['nvidia-modelopt']}, "
                                 f"transformers {sw['transformers']}, tritonclient {sw['tritonclient']}, "
                                 f"LoadGen {sw['mlcommons-loadgen']}, numpy {sw['numpy']}"),
        "operating_system": _os_name(),
        "sw_notes": "",
    }
