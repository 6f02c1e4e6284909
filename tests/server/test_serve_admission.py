"""Requests that pass field validation but would overflow a tensor dtype inside a step (and so kill the
engine for good), against the real `turnout serve` (session server): admission must refuse each with a 400
naming the field, and the server must go on answering."""

from __future__ import annotations

import httpx
import pytest

from test_serve_robustness import CHAT, COMP, MSGS, assert_error, post, still_ok
from turnout.engine.sampling_params import SamplingParams

openai = pytest.importorskip("openai")

VOCAB = 49152  # SmolLM2-135M


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _alive(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    still_ok(server)


def test_top_k_beyond_int32_is_400_and_the_engine_lives(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=4, extra_body={"top_k": 2147483648})
    assert e.value.body["param"] == "top_k" and "top_k" in e.value.body["message"]
    _alive(server)


def test_stop_token_id_beyond_int64_is_400_and_the_engine_lives(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=4,
                                  extra_body={"min_tokens": 1, "stop_token_ids": [1180591620717411303424]})
    assert e.value.body["param"] == "stop_token_ids"
    _alive(server)


ADMISSION_CASES = [
    # token ids inside int64 but outside the vocabulary: they used to ban real tokens (banned % (vocab + 1))
    (COMP, {"prompt": "Hi", "min_tokens": 1, "max_tokens": 2, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    (COMP, {"prompt": "Hi", "min_tokens": 1, "max_tokens": 2, "stop_token_ids": [2**63 - 1]}, "stop_token_ids"),
    (COMP, {"prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (COMP, {"prompt": "Hi", "top_k": -(2**40)}, "top_k"),
    (COMP, {"prompt": "Hi", "seed": 2**64}, "seed"),
    (COMP, {"prompt": "Hi", "max_tokens": 2**31}, "max_tokens"),
    (COMP, {"prompt": "Hi", "min_tokens": 2**63, "max_tokens": 4}, "min_tokens"),
    (COMP, {"prompt": "Hi", "n": 2**64}, "n"),
    (COMP, {"prompt": "Hi", "logprobs": 2**64}, "logprobs"),
    (COMP, {"prompt": "Hi", "best_of": 2**64}, "best_of"),
    (COMP, {"prompt": "Hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    # echo detokenises the prompt: invalid ids are a 400 before that, not a tokenizer OverflowError
    (COMP, {"prompt": [-1], "max_tokens": 1, "echo": True}, "prompt"),
    (COMP, {"prompt": [VOCAB], "max_tokens": 1, "echo": True}, "prompt"),
    (COMP, {"prompt": [[1, 2], [3, -7]], "max_tokens": 1, "echo": True}, "prompt"),
    (CHAT, {"messages": MSGS, "top_k": 2147483648}, "top_k"),
    (CHAT, {"messages": MSGS, "min_tokens": 1, "stop_token_ids": [1180591620717411303424]}, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 2**63}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", ADMISSION_CASES,
                         ids=[f"{i}-{p.rsplit('/', 1)[1]}-{param}" for i, (p, _, param) in enumerate(ADMISSION_CASES)])
def test_unrepresentable_value_is_400_naming_the_field(server, path, body, param):
    err = assert_error(post(server, path, body), 400, param)
    assert param.split(".")[0] in err["message"]


def test_after_the_unrepresentable_values(server):
    _alive(server)


def test_top_k_at_the_vocabulary_and_int32_max_means_off(server):
    """top_k >= vocab keeps every token: the same greedy answer as top_k off."""
    base = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    want = post(server, COMP, base).json()["choices"][0]["text"]
    for k in (VOCAB, 2**31 - 1):
        r = post(server, COMP, {**base, "top_k": k})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want


def test_in_vocabulary_stop_token_id_with_min_tokens(server):
    r = post(server, COMP, {"prompt": "Hi", "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [VOCAB - 1, 0],
                            "seed": -(2**63)})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 2


# ------------------------------------------------------------------------------ the Python API, directly
@pytest.mark.parametrize("kwargs,field", [
    ({"top_k": 2**31}, "top_k"), ({"top_k": True}, "top_k"), ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"), ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(5000))}, "stop_token_ids"), ({"max_tokens": 2**31}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("-inf")}, "min_p"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": 10**400}, "presence_penalty"), ({"logit_bias": {"1": 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stop": "x" * 5000}, "stop"), ({"n": 129}, "n"), ({"logprobs": 21}, "logprobs"),
])
def test_sampling_params_refuses_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_verify_for_model():
    p = SamplingParams(stop_token_ids=[0, 99], logit_bias={5: -100.0}, top_k=2**31 - 1)
    p.verify_for_model(100)
    assert p.top_k == 0  # at or above the vocabulary: off
    p = SamplingParams(top_k=99)
    p.verify_for_model(100)
    assert p.top_k == 99
    with pytest.raises(ValueError, match="^stop_token_ids:.*100"):
        SamplingParams(stop_token_ids=[100]).verify_for_model(100)
    with pytest.raises(ValueError, match="^logit_bias:.*100"):
        SamplingParams(logit_bias={100: 1.0}).verify_for_model(100)
