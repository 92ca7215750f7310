"""The reference side of chat_template_test.cpp: transformers' own chat-template renderer (the one
apply_chat_template uses: a sandboxed Jinja2 environment with trim_blocks and lstrip_blocks, its
raise_exception, strftime_now and generation-tag extensions), from the project's venv. Reads a JSON
array of {template, context} cases and writes a JSON array of {text} or {error} results.

usage: chat_template_reference.py CASES OUT
"""
import json
import sys

from transformers.utils.chat_template_utils import _compile_jinja_template


def main():
    cases = json.load(open(sys.argv[1], encoding="utf-8"))
    results = []
    for case in cases:
        try:
            results.append({"text": _compile_jinja_template(case["template"]).render(**case["context"])})
        except Exception as e:  # the template's own raise_exception, or a Jinja error
            results.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(results, open(sys.argv[2], "w", encoding="utf-8"))


if __name__ == "__main__":
    main()
