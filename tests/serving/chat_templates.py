"""Excerpts of the chat templates of the model families `conf/model` offers or users point the server at, copied
from each model's `tokenizer_config.json` (`chat_template`) on the Hugging Face Hub; only the lines that teach
the model its tool-call format, plus the header lines that identify the family. Models cannot be downloaded here.
"""

from __future__ import annotations

# Qwen/Qwen3-8B (and Qwen3-4B): tokenizer_config.json, the tools block of its chat template.
QWEN3 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
)

# meta-llama/Llama-3.1-8B-Instruct: tokenizer_config.json (JSON tool calling and the built-in tools' python tag).
LLAMA_3_1 = (
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if builtin_tools is defined or tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.' }}\n"
    "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
    "        {%- else  %}\n"
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
    '            {{- \'"parameters": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- "}" }}\n'
)

# meta-llama/Llama-3.2-3B-Instruct: tokenizer_config.json (no built-in tools, so no python tag).
LLAMA_3_2 = (
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n{%- if tools is not none %}\n'
    '    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.' }}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "        {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n        {{- '\"parameters\": ' }}\n"
    '        {{- tool_call.arguments | tojson }}\n        {{- "}" }}\n'
)

# mistralai/Mistral-7B-Instruct-v0.3: tokenizer_config.json.
MISTRAL_V03 = (
    '{%- for message in loop_messages %}\n    {%- if message["role"] == "user" %}\n'
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    '            {{- "[AVAILABLE_TOOLS] [" }}\n'
    '            {{- "[/AVAILABLE_TOOLS]" }}\n        {%- endif %}\n'
    '            {{- "[INST] " + message["content"] + "[/INST]" }}\n'
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    '        {{- "[TOOL_CALLS] [" }}\n        {%- for tool_call in message.tool_calls %}\n'
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    '                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "            {%- endif %}\n"
)

# HuggingFaceTB/SmolLM2-135M-Instruct (the embedded default): plain ChatML, no tool format of its own.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
