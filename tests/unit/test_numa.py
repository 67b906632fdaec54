"""NUMA node discovery from a sysfs-shaped directory."""
from __future__ import annotations

import pytest

from shared.errors import ConfigError
from worker.numa import list_nodes, node_cpus, parse_cpulist


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    with pytest.raises(ConfigError):
        parse_cpulist("0-x")


def make_nodes(root, lists):
    for node, cpus in lists.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpus + "\n")
    return root


def test_two_nodes(tmp_path):
    root = make_nodes(tmp_path, {0: "0-3", 1: "4-7"})
    assert list_nodes(root) == [0, 1]
    assert node_cpus(1, root) == [4, 5, 6, 7]


def test_missing_node_is_a_clear_error(tmp_path):
    root = make_nodes(tmp_path, {0: "0-3"})
    with pytest.raises(ConfigError, match="NUMA node 3 does not exist.*nodes: 0"):
        node_cpus(3, root)


def test_memory_only_node(tmp_path):
    root = make_nodes(tmp_path, {0: "0-1", 1: ""})
    with pytest.raises(ConfigError, match="no CPUs"):
        node_cpus(1, root)


def test_host_without_numa_info_is_node_zero(tmp_path):
    missing = tmp_path / "absent"
    assert list_nodes(missing) == [0]
    assert len(node_cpus(0, missing)) >= 1
    with pytest.raises(ConfigError):
        node_cpus(1, missing)
