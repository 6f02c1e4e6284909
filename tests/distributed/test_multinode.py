"""A two-"node" engine on one machine, over loopback: `turnout generate -tp 2 --nnodes 2 --node-rank 0` (the
engine, rank 0) and `turnout serve --headless --node-rank 1` (rank 1, no HTTP), two processes that meet only
through --master-addr / --master-port. Their greedy text equals `turnout generate` with one rank, and the
headless node exits 0 once the head is done. A busy master port is a start-up error naming the address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from tiny_tok_model import write_tiny_model  # tests/distributed is on sys.path (pytest's rootdir rule)
from turnout.distributed import free_port

PROMPT = "t5 t17 t3 t250 t9 t9 t40"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_tok"))


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
CLI = [sys.executable, "-m", "turnout.entrypoints.cli"]


def _generate(tiny, *extra):
    """`turnout generate` of PROMPT (on the CPU unless extra gives --device: argparse keeps the last)."""
    return CLI + ["generate", "--model", tiny, "--device", "cpu", "--max-tokens", "16", "--temperature", "0",
                  *extra, PROMPT]


def test_two_nodes_over_loopback_equal_one_rank(tiny):
    port = free_port()
    multi = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    # the headless node first: it waits for the head's store (as a node started before the head does)
    node1 = subprocess.Popen(CLI + ["serve", tiny, "--device", "cpu", "--headless", "--node-rank", "1", *multi],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        head = subprocess.run(_generate(tiny, "--node-rank", "0", *multi), env=ENV, capture_output=True, text=True,
                              timeout=240)
        node1_rc = node1.wait(timeout=60)  # the head quit: the headless node's rank leaves, and so does it
    finally:
        if node1.poll() is None:
            node1.kill()
    node1_log = node1.stdout.read()
    assert head.returncode == 0, head.stderr[-3000:] + node1_log[-3000:]
    assert node1_rc == 0, node1_log[-3000:]
    one = subprocess.run(_generate(tiny), env=ENV, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "16 tokens" in head.stderr and len(one.stdout.split()) >= 8
    assert head.stdout == one.stdout


def test_busy_master_port_names_the_address(tiny):
    from turnout import LLM

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"master_port: cannot listen on 127.0.0.1:{port}"):
            LLM(tiny, device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port, kv_cache_memory=1 << 20)


@pytest.mark.parametrize("kwargs,field", [(dict(tensor_parallel_size=2, nnodes=3), "nnodes"),
                                          (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
                                          (dict(master_port=70000), "master_port"),
                                          (dict(tensor_parallel_size=2, nnodes=2,
                                                distributed_executor_backend="ray"), "nnodes")])
def test_bad_multinode_config_names_the_field(kwargs, field):
    from turnout.config import EngineConfig

    with pytest.raises(ValueError, match=f"^{field}: "):
        EngineConfig(**kwargs)


def test_a_node_other_than_0_runs_no_engine(tiny):
    from turnout import LLM

    with pytest.raises(ValueError, match="node_rank: node 1 runs no engine"):
        LLM(tiny, device="cpu", tensor_parallel_size=2, nnodes=2, node_rank=1)
    p = subprocess.run(CLI + ["serve", tiny, "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--port", "0"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--node-rank: node 1 runs no engine and serves no HTTP; add --headless" in p.stderr


def test_headless_on_node_0_is_refused(tiny):
    p = subprocess.run(CLI + ["serve", tiny, "-tp", "2", "--nnodes", "2", "--headless"], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "node_rank: --headless runs node 1..1" in p.stderr


@pytest.mark.gpu
def test_two_nodes_on_two_gpus_equal_one_node(tiny):
    """NCCL: node 0 on GPU 0, node 1 on GPU 1 (each sees one: its rank's device is local index 0), against
    `generate -tp 2` on one node with the same two GPUs (the same all-reduce, so the same text)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    port = free_port()
    multi = ["-tp", "2", "--nnodes", "2", "--master-port", str(port), "--device", "cuda"]
    node1 = subprocess.Popen(CLI + ["serve", tiny, "--headless", "--node-rank", "1", *multi],
                             env={**ENV, "CUDA_VISIBLE_DEVICES": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        head = subprocess.run(_generate(tiny, "--node-rank", "0", *multi), env={**ENV, "CUDA_VISIBLE_DEVICES": "0"},
                              capture_output=True, text=True, timeout=300)
        node1_rc = node1.wait(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    node1_log = node1.stdout.read()
    assert head.returncode == 0 and node1_rc == 0, head.stderr[-3000:] + node1_log[-3000:]
    one = subprocess.run(_generate(tiny, "-tp", "2", "--device", "cuda"), env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert head.stdout == one.stdout and len(one.stdout.split()) >= 8
