"""Writes tests/fixtures/chat/expected.json: chat templates rendered by transformers, the reference for maxshard's.

Run once, by hand, in the venv of tools/make_hf_fixtures.py (transformers is never a dependency of maxshard):

    /work/hfvenv/bin/python tools/make_chat_fixtures.py

For each template (ChatML as Qwen writes it, the same with `{% generation %}` tags, a Llama-3 style one, a Mistral
style one that refuses turns out of order, and maxshard's default) and each conversation it records
`apply_chat_template(..., tokenize=False)` with and without the generation prompt (or the error it raised), and,
with the qwen3 fixture's tokenizer, the ids and `return_assistant_tokens_mask` (templates with generation tags).
The templates are also written as .jinja files, so runs can name them with `chat_template=`.
"""

from __future__ import annotations

import ast
import json
import pathlib

from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"


def _default_template() -> str:
    """maxshard's DEFAULT_TEMPLATE, read from its source (importing maxshard would need jax in this venv)."""
    tree = ast.parse((ROOT / "maxshard" / "data" / "chat_template.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "DEFAULT_TEMPLATE")
    return ast.literal_eval(node.value)


CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_GENERATION = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ message['content'] | trim }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = """{{ bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
MISTRAL = """{{ bos_token }}{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]{% else %}
{{ message['content'] }}{{ eos_token }}{% endif %}
{% endfor %}"""
TEMPLATES = {"chatml": CHATML, "chatml_generation": CHATML_GENERATION, "llama3": LLAMA3, "mistral": MISTRAL,
             "default": _default_template()}
CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": " hello! "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "and 3+3, in words?"},
     {"role": "assistant", "content": "six\nthat is"}],
    [{"role": "user", "content": "naïve café — ünïcode"},
     {"role": "assistant", "content": "the json: {\"a\": [1, 2]}"}],
    [{"role": "user", "content": "one"}, {"role": "user", "content": "two in a row"},
     {"role": "assistant", "content": "ok"}],
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ROOT / "tests" / "fixtures" / "hf" / "qwen3")
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    cases = []
    for name, template in TEMPLATES.items():
        (OUT / f"{name}.jinja").write_text(template)
        for i, messages in enumerate(CONVERSATIONS):
            case = {"template": name, "conversation": i}
            for prompt in (False, True):
                try:
                    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                   add_generation_prompt=prompt, **specials)
                except Exception as e:  # noqa: BLE001 - the template refused the conversation
                    case["error"] = type(e).__name__
                    break
                case["prompt_text" if prompt else "text"] = text
            if "error" not in case and name == "chatml_generation":
                out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True, **specials)
                case["ids"], case["assistant_mask"] = list(out["input_ids"]), list(out["assistant_masks"])
            cases.append(case)
    expected = {"specials": specials, "conversations": CONVERSATIONS, "cases": cases}
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
