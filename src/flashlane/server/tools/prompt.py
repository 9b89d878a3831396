"""A tool conversation for a chat template that does not render tools (SmolLM2's, Llama-2-style
and other plain templates), rewritten into plain messages, Hermes-style:

* the tools and the instruction to answer with ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` go into the system message (after its own text, or as a new first message);
* an assistant message's calls become that text, after its content;
* tool results become a user turn of ``<tool_response>`` blocks (consecutive results share one).

So such a model sees its tools and its earlier calls, and its answer is read by the Hermes parser.
"""

from __future__ import annotations

import json

INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call functions to help with the user's request. Their signatures, as JSON, are "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object of its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def tools_text(tools: list[dict]) -> str:
    return INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: dict) -> str:
    fn = call["function"]
    return ("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
            + "\n</tool_call>")


def with_tools_as_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out: list[dict] = []
    results_open = False   # the last message out is a turn of tool results
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if results_open:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            results_open = True
            continue
        results_open = False
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        if out and out[0]["role"] == "system" and out[0]["content"]:
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools_text(tools)}"}
        elif out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": tools_text(tools)}
        else:
            out.insert(0, {"role": "system", "content": tools_text(tools)})
    return out
