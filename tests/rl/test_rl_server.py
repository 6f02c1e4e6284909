"""The RL endpoints of a real ``turnout serve --enable-rl-endpoints`` (tiny float32 Qwen3 on the CPU), with
httpx: the API key guards them, sleep -> generating is a 503 -> wake_up -> the same greedy tokens, pause
abort while a stream runs ends it with finish_reason "abort", pause keep / resume, update weights from a
changed checkpoint changes the output (and back), bad values are 400s naming the field; without the flag
the endpoints are 404 (an in-process app)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

KEY = {"Authorization": "Bearer rl-key"}
PROMPT = [3, 17, 42, 8, 91, 5, 60]


def _save(path, seed):
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=4096)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(path, safe_serialization=True)
    # a word-level tokenizer over the 96 ids ("t0" .. "t95"), so the answers have text to compare
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base, other = tmp_path_factory.mktemp("rl_a"), tmp_path_factory.mktemp("rl_b")
    _save(base, 0)
    _save(other, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("log") / "serve.log", "w+")
    cmd = [sys.executable, "-m", "turnout.entrypoints.cli", "serve", str(base), "--port", str(port), "--dtype",
           "float32", "--device", "cpu", "--enable-rl-endpoints", "--api-key", "rl-key", "--max-model-len", "4096"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log.name).read()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        time.sleep(0.25)
    try:
        yield url, str(base), str(other)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _complete(url, max_tokens=6, **kw):
    r = httpx.post(url + "/v1/completions", headers=KEY, timeout=60,
                   json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **kw})
    return r


def _post(url, path, body=None):
    return httpx.post(url + path, headers=KEY, json=body or {}, timeout=60)


def test_key_sleep_wake_same_output(server):
    url, _, _ = server
    assert httpx.post(url + "/sleep", json={}).status_code == 401  # behind the API key
    before = _complete(url).json()["choices"][0]
    assert before["text"].strip()
    assert _post(url, "/sleep", {"level": 1}).json() == {"is_sleeping": True}
    assert httpx.get(url + "/is_sleeping", headers=KEY).json() == {"is_sleeping": True}
    r = _complete(url)
    assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
    assert _post(url, "/wake_up", {"tags": ["weights", "kv_cache"]}).json() == {"is_sleeping": False}
    assert _complete(url).json()["choices"][0]["text"] == before["text"]


def test_bad_values_name_the_field(server):
    url, _, _ = server
    for path, body, field in [("/sleep", {"level": 3}, "level"), ("/sleep", {"level": "1"}, "level"),
                              ("/pause", {"mode": "later"}, "mode"), ("/wake_up", {"tags": ["gpu"]}, "tags"),
                              ("/update_weights_from_disk", {}, "path"),
                              ("/update_weights_from_disk", {"path": "/nonexistent/ckpt"}, "path"),
                              ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []},
                               "names")]:
        r = _post(url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == field or field in r.json()["error"]["message"], r.text


def test_pause_abort_while_generating_then_resume(server):
    """A long request in flight (4000 tokens: many seconds here) ends with finish_reason "abort" and its
    partial tokens when the trainer pauses with mode "abort"; new requests are 503 until /resume."""
    url, _, _ = server
    got = {}
    t = threading.Thread(target=lambda: got.update(r=_complete(url, max_tokens=4000, ignore_eos=True)))
    t.start()
    deadline = time.monotonic() + 30
    aborted = []
    while not aborted and time.monotonic() < deadline:  # until the request is in the engine
        time.sleep(0.2)
        r = _post(url, "/pause", {"mode": "abort"})
        assert r.status_code == 200
        aborted = r.json()["aborted"]
        if not aborted:
            _post(url, "/resume")
    t.join(60)
    assert len(aborted) == 1
    choice = got["r"].json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < got["r"].json()["usage"]["completion_tokens"] < 4000
    assert httpx.get(url + "/is_paused", headers=KEY).json() == {"is_paused": True}
    assert _complete(url).status_code == 503
    _post(url, "/resume")
    assert _complete(url).status_code == 200


def test_update_weights_from_disk_changes_output(server):
    url, base, other = server
    before = _complete(url).json()["choices"][0]["text"]
    assert _post(url, "/update_weights_from_disk", {"path": other}).json()["updated"] > 0
    changed = _complete(url).json()["choices"][0]["text"]
    assert changed != before
    _post(url, "/update_weights_from_disk", {"path": base})
    assert _complete(url).json()["choices"][0]["text"] == before
    assert _post(url, "/reset_prefix_cache").status_code == 200


def test_without_the_flag_they_are_404():
    from fastapi.testclient import TestClient

    from turnout.entrypoints.openai.api_server import ServerState, build_app

    app = build_app(ServerState(engine_factory=lambda: (_ for _ in ()).throw(RuntimeError("no engine"))))
    with TestClient(app) as c:
        assert c.post("/sleep", json={}).status_code == 404
        assert c.get("/is_sleeping").status_code == 404
