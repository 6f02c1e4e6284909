"""The RL endpoints of a real ``turnout serve --enable-rl-endpoints`` against hostile or broken input (tiny
float32 Qwen3 on the CPU, httpx): a weight-update group pointed at a closed port fails within the caller's
timeout while the engine keeps streaming tokens; malformed checkpoints (a shard path out of the directory,
bad index JSON, a missing shard, truncated files, wrong shapes and dtypes, unknown tensors) are 400s naming
the file and the tensor, and the engine still answers with its old weights; /health says when it sleeps."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from test_rl_server import KEY, _complete, _post, server  # noqa: E402,F401 - the module's server fixture


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_weight_group_to_closed_port_times_out_while_generating(server):
    """Before: the engine thread blocked in the TCPStore connect for 10 minutes, generation stopped."""
    url, _, _ = server
    tokens_at = []  # arrival time of each streamed token

    def stream():
        with httpx.stream("POST", url + "/v1/completions", headers=KEY, timeout=120,
                          json={"prompt": [3, 17, 42], "max_tokens": 600, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens_at.append(time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while not tokens_at and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tokens_at, "the stream never started"
    t0 = time.monotonic()
    r = httpx.post(url + "/init_weight_update_group", headers=KEY, timeout=30,
                   json={"master_address": "127.0.0.1", "master_port": _closed_port(), "rank_offset": 1,
                         "world_size": 2, "timeout": 3})
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert "127.0.0.1" in err["message"] and "timeout=3s" in err["message"], err
    assert 2.5 < took < 10, took
    during = [x for x in tokens_at if t0 + 0.5 < x < t0 + took - 0.5]
    assert len(during) >= 3, f"the engine stopped generating during the wait ({len(during)} tokens)"
    t.join(120)
    assert _complete(url).status_code == 200  # the engine is unharmed


def test_broadcast_that_never_comes_times_out_and_drops_the_group(server):
    """A trainer that joins but never sends: the update fails within its timeout, nothing is written, the
    group is dropped (a new one must be formed) and the engine generates as before. Before: 10 minutes."""
    from turnout.worker.weight_broadcast import stateless_group

    url, _, _ = server
    before = _complete(url, max_tokens=8).json()["choices"][0]["text"]
    port = _closed_port()
    box = {}
    trainer = threading.Thread(target=lambda: box.update(
        g=stateless_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)))
    trainer.start()
    r = _post(url, "/init_weight_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                  "rank_offset": 1, "world_size": 2, "timeout": 20})
    trainer.join(30)
    assert r.status_code == 200 and r.json() == {"ranks": [1]}, r.text
    t0 = time.monotonic()
    r = _post(url, "/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                        "shapes": [[64]], "timeout": 2})
    assert r.status_code == 504 and r.json()["error"]["code"] == "trainer_timeout", r.text
    assert time.monotonic() - t0 < 15
    r = _post(url, "/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                        "shapes": [[64]], "timeout": 2})
    assert r.status_code == 409 and "init_weight_update_group" in r.json()["error"]["message"], r.text
    assert not httpx.get(url + "/is_paused", headers=KEY).json()["is_paused"]
    assert _complete(url, max_tokens=8).json()["choices"][0]["text"] == before


def test_weight_group_timeout_is_checked(server):
    url, _, _ = server
    for bad in (0, -1, "3", True):
        r = _post(url, "/init_weight_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                     "rank_offset": 1, "world_size": 2, "timeout": bad})
        assert r.status_code == 400 and "timeout" in r.json()["error"]["message"], (bad, r.text)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _variant(base: Path, root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    shutil.copy(base / "model.safetensors", d / "model.safetensors")
    return d


def _broken_checkpoints(base: Path, root: Path):
    """(directory, what the 400's message must name) for each way a checkpoint can be broken."""
    src = base / "model.safetensors"
    header, data = _header(src)
    tensor = next(k for k in header if k.endswith("q_proj.weight"))

    d = root / "traversal"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {tensor: "../../etc/passwd"}}))
    yield d, ["../../etc/passwd", "model.safetensors.index.json"]

    d = root / "absolute"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {tensor: str(src)}}))
    yield d, [str(src)]

    d = root / "bad_index"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text('{"weight_map": {')
    yield d, ["model.safetensors.index.json"]

    d = root / "missing_shard"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {tensor: "shard-1.safetensors"}}))
    yield d, ["shard-1.safetensors"]

    d = _variant(base, root, "truncated_data")
    (d / "model.safetensors").write_bytes(src.read_bytes()[:-100])
    yield d, ["model.safetensors", "truncated"]

    d = _variant(base, root, "truncated_header")
    (d / "model.safetensors").write_bytes(src.read_bytes()[:20])
    yield d, ["model.safetensors", "truncated"]

    d = _variant(base, root, "header_not_json")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{[" + b"\0" * 16)
    yield d, ["model.safetensors"]

    for what, change in (("wrong_shape", lambda e: {**e, "shape": [e["shape"][0] // 2, e["shape"][1] * 2]}),
                         ("wrong_dtype", lambda e: {**e, "dtype": "I32"}),
                         ("odd_dtype", lambda e: {**e, "dtype": "F8_E8M0", "shape": [e["shape"][0],
                                                                                    e["shape"][1] * 4]})):
        d = _variant(base, root, what)
        h = dict(header)
        h[tensor] = change(h[tensor])
        _write(d / "model.safetensors", h, data)
        yield d, ["model.safetensors", tensor]

    d = _variant(base, root, "unknown_tensor")
    h = dict(header)
    h["model.layers.0.self_attn.nonsense.weight"] = h.pop(tensor)
    _write(d / "model.safetensors", h, data)
    yield d, ["model.safetensors", "model.layers.0.self_attn.nonsense.weight"]

    d = _variant(base, root, "offsets_overlap")
    h = dict(header)
    h[tensor] = {**h[tensor], "data_offsets": [0, h[tensor]["data_offsets"][1] - h[tensor]["data_offsets"][0]]}
    _write(d / "model.safetensors", h, data)
    yield d, ["model.safetensors"]


def test_malformed_checkpoints_are_400s_naming_file_and_tensor(server, tmp_path):
    """Before: the ``../../etc/passwd`` shard was opened and parsed, and most of these were 500s."""
    url, base, _ = server
    before = _complete(url, max_tokens=8).json()["choices"][0]["text"]
    for d, names in _broken_checkpoints(Path(base), tmp_path):
        r = _post(url, "/update_weights_from_disk", {"path": str(d)})
        assert r.status_code == 400, (d.name, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == "path", (d.name, err)
        for name in names:
            assert name in err["message"], (d.name, name, err["message"])
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert not httpx.get(url + "/is_paused", headers=KEY).json()["is_paused"]
    assert _complete(url, max_tokens=8).json()["choices"][0]["text"] == before  # the old weights, untouched


def test_health_says_asleep(server):
    url, _, _ = server
    assert httpx.get(url + "/health").status_code == 200 and not httpx.get(url + "/health").content
    assert _post(url, "/sleep", {"level": 1}).status_code == 200
    try:
        r = httpx.get(url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "asleep", r.text
    finally:
        assert _post(url, "/wake_up").status_code == 200
    assert httpx.get(url + "/health").status_code == 200 and not httpx.get(url + "/health").content
