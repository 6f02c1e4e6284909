"""vLLM's extras through a real `turnout serve` (the embedded SmolLM2): /tokenize and /detokenize against the
HF tokenizer of the same model, ``--chat-template`` given inline, ``--reasoning-parser`` (reasoning_content,
streamed too), ``--served-model-name`` aliases, ``--max-logprobs``, unknown request fields warned once per
name; and, without a server, the start-up refusals (``--trust-remote-code`` for a config that needs remote
code, bad --chat-template / parser flags)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import ServerProcess
from turnout.entrypoints import cli
from turnout.entrypoints.openai.serve_options import ServeOptions, load_chat_template, refuse_remote_code

openai = pytest.importorskip("openai")

# The prompt ends inside <think> (as DeepSeek-R1's template does); two worked examples show the 135M model
# how to close its reasoning, so that greedy decoding gives both reasoning_content and content.
TEMPLATE = """{%- set shots = [["What is 1+1?", "One plus one is two.", "The answer is 2."],
                     ["What is 3+3?", "Three plus three is six.", "The answer is 6."]] %}
{%- if no_shots %}{% set shots = [] %}{% endif %}
{%- for q, think, a in shots %}<|im_start|>user
{{ q }}<|im_end|>
<|im_start|>assistant
<think>
{{ think }}
</think>

{{ a }}<|im_end|>
{% endfor %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
MSGS = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess("--max-model-len", "1024", "--max-num-seqs", "4", "--seed", "0", "--chat-template", TEMPLATE,
                      "--reasoning-parser", "deepseek_r1", "--served-model-name", "smol", "alias",
                      "--max-logprobs", "3")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from turnout.loader import default_model_path
    from turnout.loader.gguf import load_tokenizer

    return load_tokenizer(default_model_path())


def test_reasoning_content_streamed_and_not(client):
    r = client.chat.completions.create(model="smol", messages=MSGS, temperature=0, max_tokens=40)
    m = r.choices[0].message
    assert m.reasoning_content and "</think>" not in m.reasoning_content and "<think>" not in m.reasoning_content
    assert m.content and "</think>" not in m.content, m
    reasoning = content = ""
    for chunk in client.chat.completions.create(model="smol", messages=MSGS, temperature=0, max_tokens=40,
                                                stream=True):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)


def test_served_model_name_aliases(client, srv):
    assert [m.id for m in client.models.list().data] == ["smol", "alias"]
    r = client.chat.completions.create(model="alias", messages=MSGS, max_tokens=1)
    assert r.model == "smol"
    r = client.completions.create(model="alias", prompt="Hi", max_tokens=1)
    assert r.model == "smol"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)
    assert e.value.body["param"] == "model"


def test_max_logprobs(client):
    for call in (lambda k: client.chat.completions.create(model="smol", messages=MSGS, max_tokens=1, logprobs=True,
                                                          top_logprobs=k),
                 lambda k: client.completions.create(model="smol", prompt="Hi", max_tokens=1, logprobs=k)):
        with pytest.raises(openai.BadRequestError) as e:
            call(4)
        assert e.value.body["param"] in ("top_logprobs", "logprobs") and "--max-logprobs" in e.value.body["message"]
        call(3)


def test_tokenize_equals_the_hf_tokenizer(srv, hf_tokenizer):
    url = srv.base_url
    for text in ["Hello world", "  spaces\tand\nnewlines ", "ünïcödé 😀 <|im_start|>", "x"]:
        r = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        want = hf_tokenizer.encode(text)
        assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == 1024
        assert r["token_strs"] == [hf_tokenizer.decode([t]) for t in want]
        back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
        assert back == hf_tokenizer.decode(want) == text
    # messages: the server's --chat-template, rendered as HF renders it
    r = httpx.post(f"{url}/tokenize", json={"messages": MSGS, "model": "alias"}).json()
    want = hf_tokenizer.apply_chat_template(MSGS, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert r["tokens"] == want and r["count"] == len(want)
    r = httpx.post(f"{url}/tokenize", json={"messages": MSGS, "add_generation_prompt": False}).json()
    assert r["count"] < len(want)
    # chat_template_kwargs: variables the template reads, as HF's apply_chat_template takes them
    r = httpx.post(f"{url}/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"no_shots": True}}).json()
    want = hf_tokenizer.apply_chat_template(MSGS, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
                                            no_shots=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert r["tokens"] == want and r["count"] < 30


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MSGS, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"),
    ("/tokenize", {"messages": MSGS, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs.chat_template"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_names_the_field(srv, path, body, param):
    r = httpx.post(f"{srv.base_url}{path}", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_fields_are_warned_once_per_name(srv):
    for _ in range(3):
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "frobnicate_x": 1,
                                                               "stream": True, "stream_options": {"zork_y": 2}},
                       timeout=60)
        assert r.status_code == 200, r.text
    time.sleep(0.2)
    log = srv.log_path.read_text()
    assert log.count("'frobnicate_x'") == 1 and log.count("'stream_options.zork_y'") == 1, log[-2000:]


# ------------------------------------------------------------------------------------- no server
def test_a_model_needing_remote_code_is_refused(tmp_path):
    cfg = {"model_type": "my_own_arch", "architectures": ["MyOwnForCausalLM"],
           "auto_map": {"AutoConfig": "modeling_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyModel"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for trust in (True, False):
        with pytest.raises(ValueError, match="never runs a model's code") as e:
            refuse_remote_code(str(tmp_path), trust)
        assert ("--trust-remote-code is accepted" in str(e.value)) == trust
    # an auto_map beside a model type transformers knows needs no remote code
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    refuse_remote_code(str(tmp_path), True)


def test_start_up_flags_are_checked(tmp_path, capsys):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    for argv, flag in [(["--chat-template", str(tmp_path / "missing.jinja")], "--chat-template"),
                       (["--chat-template", "{% for %}"], "--chat-template"),
                       (["--enable-auto-tool-choice"], "--enable-auto-tool-choice"),
                       (["--max-logprobs", "21"], "--max-logprobs")]:
        assert cli.main(["serve", "--port", "0", *argv]) == 2
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--tool-call-parser", "nope"])
    assert ServeOptions(enable_auto_tool_choice=True, tool_call_parser="mistral").auto_tools
