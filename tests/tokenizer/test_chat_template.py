"""A checkpoint folder's own Jinja chat template, tools included, renders exactly as
``transformers``' ``apply_chat_template`` renders it (issue 18, must-show 3); its ids are what
the router hashes, and a later turn's prompt extends the earlier one (prefix caching)."""

from __future__ import annotations

import json

import pytest

from k3serve.tokenizer import get_tokenizer

# A Kimi-K2-style template: tools first, then the history; tool calls in the Kimi format;
# tool results name their call. No dates or other changing text before the history.
TEMPLATE = """{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ message['tool_call_id'] }}
{{ message['content'] }}<|im_end|>
{%- else -%}
<|im_{{ 'user' if message['role'] == 'user' else 'assistant' if message['role'] == 'assistant' else 'system' }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] or '' }}
{%- if message.get('tool_calls') -%}
<|tool_calls_section_begin|>
{%- for tc in message['tool_calls'] -%}
<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>{{ tc['function']['arguments'] }}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""

SPECIALS = ["<|bos|>", "<|eos|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

TURN1 = [{"role": "system", "content": "You are K3."},
         {"role": "user", "content": "Weather in Paris? é 天"}]
TURN2 = TURN1 + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    d = tmp_path_factory.mktemp("ckpt")
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.mark.parametrize("messages, tools, gen", [
    (TURN1, None, True), (TURN1, TOOLS, True), (TURN2, TOOLS, True), (TURN2, TOOLS, False)])
def test_renders_exactly_as_transformers(folder, messages, tools, gen):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                  tokenize=False)
    ours = get_tokenizer(str(folder))
    got = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False,
                                   tools=tools)
    assert got == want
    ids = ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools)
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    if tools:
        assert "<|tool_call_begin|>" not in want or ours.special_tokens["<|tool_call_begin|>"] in ids


def test_a_later_turn_extends_the_earlier_prompt(folder):
    ours = get_tokenizer(str(folder))
    t1 = ours.apply_chat_template(TURN1, add_generation_prompt=False, tools=TOOLS)
    t2 = ours.apply_chat_template(TURN2, add_generation_prompt=True, tools=TOOLS)
    assert t2[:len(t1)] == t1  # the history is a prefix: the router's block hashes match


def test_router_chat_jobs_use_the_folder_template(folder):
    from router.preprocess import Preprocessor
    from router.schemas import ChatCompletionRequest

    ours = get_tokenizer(str(folder))
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": TURN2, "tools": TOOLS})
    job = Preprocessor(ours, add_bos=False).chat_jobs(req, 1 << 20)[0]
    assert job.token_ids == ours.apply_chat_template(TURN2, tools=TOOLS)


def test_embedded_byte_template_renders_tools_and_calls():
    tok = get_tokenizer("byte")
    text = tok.apply_chat_template(TURN2, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n[{")
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
            "<|tool_calls_section_end|>") in text
    assert "<|im_start|>tool:functions.get_weather:0\n18 C<|im_end|>" in text
    ids = tok.apply_chat_template(TURN2, tools=TOOLS)
    assert 270 in ids and max(ids) < 272  # the call marker is one added token
