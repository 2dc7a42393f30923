"""A chat template with the ``<think>`` convention of Qwen3 and DeepSeek-R1, over SmolLM2's ChatML
tokens: the assistant's turn opens ``<think>`` in the prompt, ``enable_thinking: false`` writes an
empty block instead (Qwen3's way), and ``reasoning_effort`` goes into the system turn. SmolLM2 does
not think; the tests make it write a reasoning block with a grammar, so the split is exercised
through the real server."""
from __future__ import annotations

THINK_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning effort: {{ reasoning_effort }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
