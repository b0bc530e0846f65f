"""The ingress's tokenizer against the real engine's POST /tokenize: the same token ids
for text prompts and chats, or the ingress keys blocks nobody holds."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from catsproto.adapters.tokenizer import PromptError, PromptTokenizer

PROMPTS = [
    "Hello KV",
    "",
    " ",
    "naïve café — 日本語 🚀 ∑ Ω",
    "  leading spaces\nnew lines\n\n\ttabs and trailing  ",
    "<|user|>special tokens in text</s><s>",
    "KV blocks are 32 tokens. " * 40,
]

CHATS = [
    [{"role": "user", "content": "Hello KV"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again ☃ 日本"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
        }
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": []}],
    [{"role": "assistant", "content": None}, {"role": "user", "content": "after null"}],
    [{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "x"}, {"role": "developer", "content": "a later rule"}],
    [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nthe real system"},
        {"role": "user", "content": "y"},
    ],
]


def engine_tokens(engine, body: dict) -> list[int]:
    req = urllib.request.Request(
        engine.url + "/tokenize",
        json.dumps({"model": engine.served_model_name, **body}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["tokens"]


@pytest.fixture(scope="module")
def tokenizer(vllm_engine):
    return PromptTokenizer(vllm_engine.model_dir)


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_text_prompts_tokenize_as_the_engine_does(vllm_engine, tokenizer, prompt):
    ours = tokenizer.completion_ids(prompt)
    assert ours == engine_tokens(vllm_engine, {"prompt": prompt})
    assert tokenizer.completion_ids([prompt]) == ours  # a batch of one


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chats_render_and_tokenize_as_the_engine_does(
    vllm_engine,
    tokenizer,
    chat,
    generation_prompt,
):
    ours = tokenizer.chat_ids(chat, add_generation_prompt=generation_prompt)
    theirs = engine_tokens(
        vllm_engine, {"messages": chat, "add_generation_prompt": generation_prompt}
    )
    assert ours == theirs and ours


def test_continue_final_message_cuts_where_the_engine_does(vllm_engine, tokenizer):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    assert tokenizer.chat_ids(chat, **options) == engine_tokens(
        vllm_engine, {"messages": chat, **options}
    )


def test_the_known_rendering_of_one_turn(tokenizer):
    chat = [{"role": "user", "content": "Hello KV"}]
    assert tokenizer.render_chat(chat) == "<|user|>Hello KV<|end|><|assistant|>"
    assert tokenizer.chat_ids(chat) == [4, 46, 316, 333, 227, 49, 60, 6, 5]


def test_token_ids_pass_as_they_are(tokenizer):
    assert tokenizer.completion_ids([5, 6, 7]) == [5, 6, 7]
    assert tokenizer.completion_ids([[5, 6, 7]]) == [5, 6, 7]
    assert tokenizer.completion_ids([]) == []


@pytest.mark.parametrize(
    "prompt, words",
    [
        (["a", "b"], "batch of 2"),
        ([[1], [2]], "batch of 2"),
        ([1, -2], "token ids"),
        ([1, True], "token ids"),
        ([1, 2**32], "token ids"),
        ([1.0], "token ids"),
        (None, "string or a list"),
        ({"text": "x"}, "string or a list"),
    ],
)
def test_bad_prompts_are_refused_with_the_field(tokenizer, prompt, words):
    with pytest.raises(PromptError, match=words) as exc:
        tokenizer.completion_ids(prompt)
    assert exc.value.param == "prompt"


@pytest.mark.parametrize(
    "messages, words",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"content": "no role"}], "string role"),
        ([{"role": "user", "content": 5}], "content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "not text"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "must be a string"),
        ([{"role": "user", "content": [7]}], "string or an object"),
    ],
)
def test_bad_chats_are_refused_with_the_field(tokenizer, messages, words):
    with pytest.raises(PromptError, match=words) as exc:
        tokenizer.chat_ids(messages)
    assert exc.value.param == "messages"


def test_the_engine_refuses_what_the_tokenizer_refuses(vllm_engine):
    """An image part: refused here, and by the text-only engine too (no silent skew)."""
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(urllib.error.HTTPError) as exc:
        engine_tokens(vllm_engine, {"messages": chat})
    assert exc.value.code == 400


def test_options_that_contradict_are_refused(tokenizer):
    chat = [{"role": "user", "content": "x"}]
    with pytest.raises(PromptError, match="cannot both"):
        tokenizer.chat_ids(chat, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(PromptError, match="tokenize"):
        tokenizer.chat_ids(chat, chat_template_kwargs={"tokenize": True})


def test_a_model_dir_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        PromptTokenizer(tmp_path)
