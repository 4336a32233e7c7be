"""Renders chat templates with Python's jinja2 exactly as Hugging Face's apply_chat_template sets it up
(an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, raise_exception as a global), the
reference for tests/unit/chat_template_test.cc.

stdin: a JSON list of {"template", "messages", "add_generation_prompt", "bos_token", "eos_token"};
stdout: a JSON list of {"ok": true, "text": ...} or {"ok": false, "error": message}.
"""
import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    results = []
    for case in json.load(sys.stdin):
        try:
            template = env.from_string(case["template"])
            text = template.render(messages=case["messages"],
                                   add_generation_prompt=case["add_generation_prompt"],
                                   bos_token=case["bos_token"], eos_token=case["eos_token"])
            results.append({"ok": True, "text": text})
        except Exception as e:  # the C++ side must refuse the same cases
            results.append({"ok": False, "error": str(e)})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
