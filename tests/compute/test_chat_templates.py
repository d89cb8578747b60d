"""Chat templates of released models (llama.cpp's ``models/templates/``, fetched by ``.ci/run``)
render through our Jinja2 environment exactly as through transformers' (the oracle), tools and
tool calls included — among them templates using transformers' ``{% generation %}`` tag."""

from __future__ import annotations

import pytest

from swarm.compute.tokenizer import _compile_template
from tests.compute.llama_converter import chat_template

TEMPLATES = ["poolside-Laguna-XS.2.jinja", "LFM2.5-8B-A1B.jinja", "Qwen3.5-4B.jinja", "GLM-4.6.jinja",
             "meta-llama-Llama-3.1-8B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja"]
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What time is it in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "12:00"},
        {"role": "assistant", "content": "Noon."},
        {"role": "user", "content": "Thanks!"}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_released_template_renders_as_transformers_renders_it(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    source = chat_template(name)
    ours = _compile_template(source).render(messages=CHAT, tools=TOOLS, add_generation_prompt=True, **SPECIAL)
    theirs, _ = render_jinja_template([CHAT], tools=TOOLS, chat_template=source, add_generation_prompt=True,
                                      **SPECIAL)
    assert ours == theirs[0] and "get_time" in ours
