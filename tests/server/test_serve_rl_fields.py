"""The RL fields of /v1/completions, with the openai client against real servers on 127.0.0.1
around a tiny float32 Qwen3 written here: ``prompt_logprobs`` (vLLM's shape: None at position 0, then
{token id: {logprob, rank, decoded_token}}) equal HF's recomputation on the same weights, bounded by
--max-logprobs; ``return_token_ids`` (prompt_token_ids and token_ids per choice, streamed as deltas that
add up to the non-streamed answer); and a model without a tokenizer: logprobs, streamed or not, name
tokens "token_id:N" (vLLM's form) instead of failing in-band with a 500."""

from __future__ import annotations

import json
import os
import shutil
import sys

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from conftest import InProcessServer, ServerProcess  # noqa: E402

VOCAB = 96
PROMPT = [3, 17, 42, 8, 91, 5, 60, 11]


def _save(path, with_tokenizer: bool):
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:  # word-level over the ids ("t0" .. "t95"): every id has its own text
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return hf.eval()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl_fields")
    hf = _save(path, with_tokenizer=True)
    return str(path), hf


@pytest.fixture(scope="module")
def server(model):
    srv = ServerProcess(model[0], "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                        "--max-logprobs", "5", "--seed", "0", env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _hf_prompt_logprobs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_prompt_logprobs_equal_hf(client, model):
    _, hf = model
    k = 3
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": k})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    ref = _hf_prompt_logprobs(hf, PROMPT)
    worst = 0.0
    for pos in range(1, len(PROMPT)):
        row = {int(t): v for t, v in plp[pos].items()}
        tok = PROMPT[pos]
        ref_row = ref[pos - 1]
        assert tok in row
        worst = max(worst, abs(row[tok]["logprob"] - float(ref_row[tok])))
        assert row[tok]["rank"] == int((ref_row > ref_row[tok]).sum()) + 1  # vLLM's rank: 1 = the best
        assert row[tok]["decoded_token"] == f"t{tok}"
        top = torch.topk(ref_row, k)
        assert set(row) - {tok} <= set(top.indices.tolist()) and set(top.indices.tolist()) <= set(row)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(row[t]["logprob"] - lp) <= 1e-5
    assert worst <= 1e-5, worst


def test_prompt_logprobs_bounded_and_checked(server):
    for value, want in [(6, 400), (-1, 400), ("2", 400), (5, 200)]:
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": value})
        assert r.status_code == want, (value, r.text)
        if want == 400:
            assert r.json()["error"]["param"] == "prompt_logprobs", r.text
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,  # echo's logprobs are bounded alike
                   json={"prompt": PROMPT, "max_tokens": 1, "logprobs": 6, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def _echo_check(hf, lp, generated: list[int]):
    """An echoed choice's logprobs (vLLM's layout): the prompt's tokens (None at position 0), then the
    generated ones; every value HF's log_softmax on the same weights."""
    ids = PROMPT + generated
    ref = _hf_prompt_logprobs(hf, ids)
    assert lp.tokens == [f"t{t}" for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - float(ref[pos - 1, ids[pos]])) <= 1e-4, pos
        top = torch.topk(ref[pos - 1], 2)
        assert {f"t{t}": pytest.approx(v, abs=1e-4) for t, v in zip(top.indices.tolist(), top.values.tolist())} \
            == lp.top_logprobs[pos]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_with_logprobs_is_the_prompt_then_the_output(client, model):
    """What lm-eval's log-likelihood tasks send: the prompt's logprobs lead the choice's, then the output's."""
    _, hf = model
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    generated = [int(ref.argmax()) for ref in _hf_prompt_logprobs(hf, PROMPT)[-1:]]
    _echo_check(hf, c.logprobs, generated)
    prompt_text = " ".join(f"t{t}" for t in PROMPT)
    assert c.text.startswith(prompt_text) and c.text != prompt_text
    assert r.usage.completion_tokens == 1 and r.usage.prompt_tokens == len(PROMPT)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "text": ""}
    for chunk in client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                                           echo=True, stream=True):
        for ch in chunk.choices:
            streamed["text"] += ch.text
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                streamed[key] += getattr(ch.logprobs, key) if ch.logprobs else []
    assert streamed == {**c.logprobs.model_dump(), "text": c.text}


def test_echo_without_generation(client, model):
    """max_tokens 0 with echo (vLLM accepts it): the prompt and its logprobs alone, no completion tokens."""
    _, hf = model
    for stream in (False, True):
        kw = dict(model=None, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=2, echo=True)
        if not stream:
            r = client.completions.create(**kw)
            c = r.choices[0]
            assert r.usage.completion_tokens == 0
            text, lp = c.text, c.logprobs
        else:
            chunks = [ch for chunk in client.completions.create(stream=True, **kw) for ch in chunk.choices]
            assert len(chunks) == 1
            c, text, lp = chunks[0], chunks[0].text, chunks[0].logprobs
        assert text == " ".join(f"t{t}" for t in PROMPT) and c.finish_reason == "length"
        _echo_check(hf, lp, [])
    r = httpx.post(str(client.base_url) + "completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_return_token_ids_plain_and_streamed(client):
    kw = dict(model=None, prompt=[PROMPT, PROMPT[:5]], max_tokens=7, temperature=0, logprobs=1,
              extra_body={"return_token_ids": True, "prompt_logprobs": 1})
    r = client.completions.create(**kw)
    assert len(r.choices) == 2
    for c, p in zip(r.choices, [PROMPT, PROMPT[:5]]):
        extra = c.model_extra
        assert extra["prompt_token_ids"] == p
        assert len(extra["token_ids"]) == 7 == len(c.logprobs.tokens)
        assert "".join(f" t{t}" for t in extra["token_ids"]).strip() == c.text.strip()
    got = {0: {"ids": [], "prompt": [], "text": "", "plp": []}, 1: {"ids": [], "prompt": [], "text": "", "plp": []}}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            g, extra = got[c.index], c.model_extra
            g["ids"] += extra["token_ids"] or []
            g["text"] += c.text
            if extra.get("prompt_token_ids") is not None:
                g["prompt"].append(extra["prompt_token_ids"])
            if extra.get("prompt_logprobs") is not None:
                g["plp"].append(extra["prompt_logprobs"])
    for i, c in enumerate(r.choices):
        assert got[i]["ids"] == c.model_extra["token_ids"]
        assert got[i]["text"] == c.text
        assert got[i]["prompt"] == [c.model_extra["prompt_token_ids"]]  # in the first chunk only
        assert got[i]["plp"] == [c.model_extra["prompt_logprobs"]]


def test_without_return_token_ids_the_fields_are_null(client):
    c = client.completions.create(model=None, prompt=PROMPT, max_tokens=2, temperature=0).choices[0]
    assert c.model_extra.get("token_ids") is None and c.model_extra.get("prompt_token_ids") is None
    assert c.model_extra.get("prompt_logprobs") is None


@pytest.fixture(scope="module")
def no_tokenizer_server(model, tmp_path_factory):
    """The same weights without a tokenizer, in-process (uvicorn on 127.0.0.1 around the real engine)."""
    from turnout.config import EngineConfig
    from turnout.engine.llm_engine import LLMEngine
    from turnout.entrypoints.openai.api_server import ServerState

    path = tmp_path_factory.mktemp("no_tok")
    for f in os.listdir(model[0]):
        if f.endswith(".safetensors") or f in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(model[0], f), path / f)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", max_model_len=512))
    assert engine.tokenizer is None
    with InProcessServer(ServerState(engine=engine)) as srv:
        yield srv


def test_no_tokenizer_logprobs_name_token_ids(no_tokenizer_server):
    """Regression: streamed logprobs on a model without a tokenizer were an in-band 500 (AttributeError in
    decoding the token's text); now tokens are "token_id:N" as in vLLM, streamed or not, and echo (which
    needs the prompt's text) is a 400 naming it."""
    url = no_tokenizer_server.base_url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_token_ids": True}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in c["logprobs"]["top_logprobs"])
    tokens, ids = [], []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                tokens += (ch["logprobs"] or {}).get("tokens", [])
                ids += ch["token_ids"] or []
    assert tokens == c["logprobs"]["tokens"] and ids == c["token_ids"]
    r = httpx.post(url, json={**body, "echo": True, "logprobs": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
