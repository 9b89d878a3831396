"""Server-sent events framing (what OpenAI's streaming endpoints send)."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
