"""Strings and the ids HF's tokenizer gives them, per golden model: the tokenizer's references.

    python golden/tokenizer_cases.py HF_DIR OUT.json

`ids` are without added specials (no BOS); `add_bos` / `bos_id` say what the model adds in
front of a prompt. Special tokens written inside a string are matched as specials. For the
models with a chat template, one conversation is rendered by `apply_chat_template`.
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

COMMON = [
    "In the beginning God created the heaven and the earth.",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nthree",
    "windows\r\nline ends\r\n",
    "12345678901234567890",
    "3.14159 and 1,000,000 and 0x1F",
    "Hello, world! How's it going? I'm fine; you'd be too.",
    "don't WON'T It's THEY'RE we'll I'VE",
    "punctuation!!! ??? ... --- ((())) ''' \"\"\"",
    "café naïve résumé Zürich São Paulo",
    "Ελληνικά και Русский текст",
    "中文测试：我想在apple工作1314151天",
    "日本語のテキスト、カタカナとひらがな",
    "한국어 텍스트",
    "emoji 🚀🦙 😶\u200d🌫️ ✅ 👍🏽",
    "mixed CJK中文and English混合",
    "fn main() { println!(\"{}\", x[0] + 1); }",
    "https://example.com/path?q=1&r=2#frag",
    "    indented\n\tdef f(x):\n\t\treturn x",
    "ALL CAPS SHOUTING and lower case",
    "zero\u200bwidth and non-breaking\u00a0space",
    "combining: e\u0301 a\u0308 and precomposed: é ä",
]
SPECIALS = {
    "ds3": ["<｜begin▁of▁sentence｜>special inside<｜end▁of▁sentence｜>", "<｜User｜>hi<｜Assistant｜>hello"],
    "v2lite": ["<｜begin▁of▁sentence｜>special inside<｜end▁of▁sentence｜>", "<｜User｜>hi<｜Assistant｜>hello"],
    "glm5": ["[gMASK]<sop><|user|>\nhi<|assistant|>\nhello", "text<|endoftext|>more"],
}
CONVERSATION = [
    {"role": "system", "content": "You answer from the Book of Genesis."},
    {"role": "user", "content": "Who made the heaven and the earth?"},
    {"role": "assistant", "content": "God created them."},
    {"role": "user", "content": "And the light?"},
]


def cases(tok, strings: list[str]) -> list[dict]:
    return [{"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]} for s in strings]


def main() -> None:
    hf, out = Path(sys.argv[1]), Path(sys.argv[2])
    result = {}
    for model in sorted(SPECIALS):
        tok = AutoTokenizer.from_pretrained(hf / model)
        with_bos = tok("x")["input_ids"]
        entry = {
            "add_bos": len(with_bos) > len(tok("x", add_special_tokens=False)["input_ids"]),
            "bos_id": tok.bos_token_id,
            "eos_id": tok.eos_token_id,
            "cases": cases(tok, COMMON + SPECIALS[model]),
        }
        if tok.chat_template:
            text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
            entry["chat"] = {
                "messages": CONVERSATION,
                "add_generation_prompt": True,
                "text": text,
                "ids": tok(text, add_special_tokens=False)["input_ids"],
            }
        result[model] = entry
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
