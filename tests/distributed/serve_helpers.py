"""What the serving tests of tests/distributed share: a tiny random checkpoint that splits over 2 ranks (with a
word-level tokenizer and a chat template, so chat works), a real `turnout serve` subprocess, and the PIDs
of its process tree (worker and replica processes), to check that none is left after it exits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1 {% endif %}"


def save_tiny(path, seed: int = 0) -> str:
    """Qwen3, 4 heads / 2 kv heads (splits over 2 ranks), float32, ids 't0'..'t95' as words."""
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(path, safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`turnout serve MODEL ARGS...` on 127.0.0.1, float32 on the CPU, one thread per process."""

    def __init__(self, model: str, *args: str, log_dir):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"serve-{self.port}.log"
        self._log = open(self.log_path, "w+")
        cmd = [sys.executable, "-m", "turnout.entrypoints.cli", "serve", model, "--port", str(self.port),
               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", str(8 << 20), "--max-model-len", "512",
               *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_healthy(self, timeout: float = 240) -> "Serve":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"turnout serve exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.25)
        raise TimeoutError(f"turnout serve not healthy after {timeout}s:\n{self.log()}")

    def descendants(self) -> list[psutil.Process]:
        """Every process under the server (TP workers, DP replicas and their workers)."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-8000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def gone(pids, timeout: float = 15.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
