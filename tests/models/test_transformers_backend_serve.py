"""A model with no native class served through transformers' modeling code: a real `turnout serve --model-impl
transformers` answers the official openai client with HF transformers' own greedy tokens, and structured output
holds through it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from turnout.models.transformers_backend.tiny import hf_greedy, save_tiny

openai = pytest.importorskip("openai")

_spec = importlib.util.spec_from_file_location(
    "server_fixtures", Path(__file__).resolve().parents[1] / "server" / "conftest.py")
server_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_fixtures)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny GPT-2 with the embedded model's tokenizer (its vocabulary), served."""
    from turnout.loader import default_model_path
    from turnout.loader.gguf import load_tokenizer

    path = tmp_path_factory.mktemp("tiny-gpt2")
    tok = load_tokenizer(default_model_path())
    hf = save_tiny("gpt2", path, vocab_size=len(tok))
    tok.save_pretrained(str(path))
    srv = server_fixtures.ServerProcess("--model", str(path), "--model-impl", "transformers", "--dtype", "float32",
                                        "--max-model-len", "256", "--max-num-seqs", "4",
                                        "--kv-cache-memory", str(16 << 20))
    try:
        srv.wait_healthy()
        yield srv, hf, tok
    finally:
        srv.stop()


def test_served_completion_is_transformers_greedy(served):
    srv, hf, tok = served
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0)
    ids = tok(prompt)["input_ids"]
    want, _ = hf_greedy(hf, ids, 12)
    assert out.choices[0].text == tok.decode(want)
    assert "transformers backend: GPT2LMHeadModel" in srv.log()


def test_served_structured_output(served):
    srv, _, _ = served
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Yes or no?", max_tokens=5, temperature=0.0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
