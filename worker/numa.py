"""NUMA nodes and their CPUs, read from sysfs.

A host without NUMA information in sysfs (some containers, non-Linux kernels) is one node 0
holding every CPU.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from shared.errors import ConfigError

SYS_NODES = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """The kernel's list format: `0-3,8,10-11` → [0, 1, 2, 3, 8, 10, 11]."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None:
            raise ConfigError(f"bad CPU list {text.strip()!r}")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def list_nodes(root: Path = SYS_NODES) -> list[int]:
    nodes = sorted(int(p.name[4:]) for p in root.glob("node[0-9]*")) if root.is_dir() else []
    return nodes or [0]


def node_cpus(node: int, root: Path = SYS_NODES) -> list[int]:
    nodes = list_nodes(root)
    if node not in nodes:
        raise ConfigError(f"NUMA node {node} does not exist on this host (nodes: {', '.join(map(str, nodes))})")
    path = root / f"node{node}" / "cpulist"
    if not path.is_file():  # no NUMA information: node 0 is the whole machine
        return list(range(os.cpu_count() or 1))
    cpus = parse_cpulist(path.read_text())
    if not cpus:
        raise ConfigError(f"NUMA node {node} has no CPUs (memory-only node)")
    return cpus
