"""Import trace files into session trees.

Formats: AgentX / "Weka" traces (one object, a list, or JSONL of objects), Mooncake-style rows
(`timestamp`, `input_length`, `output_length`, `hash_ids`: one single-turn trace per row) and
length-only agent traces (`prompt_len`, `out_lens[]`, `obs_lens[]`, optional `tool_times[]`).

Timing: think gaps are end-to-start. A turn's reference point is the recorded end of the previous
turn (`t + api_time`, or just `t` when api_time is unknown) or, for a turn gated on sub-agents, the
latest recorded end of those sub-agents; an explicit `think_time` wins. A sub-agent gates (is
joined by) the first later parent turn that starts after the sub-agent's recorded end; one still
running then, or marked `"status": "background"`, is a background agent and gates nothing (the
tree still drains only when it ends).
"""

from __future__ import annotations

import json
from pathlib import Path

from .model import Session, Spawn, Trace, Turn


class TraceError(ValueError):
    pass


def load_traces(path: str | Path) -> list[Trace]:
    """All traces in a file (format detected from content)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace: file not found: {p}")
    text = p.read_text()
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise TraceError(f"trace: {p} is neither JSON nor JSONL ({e})") from None
    if not items:
        raise TraceError(f"trace: {p} holds no traces")
    first = items[0]
    if not isinstance(first, dict):
        raise TraceError(f"trace: {p}: expected objects, got {type(first).__name__}")
    if "requests" in first:
        return [parse_agentx(d, where=f"{p.name}[{i}]") for i, d in enumerate(items)]
    if "input_length" in first:
        return parse_mooncake(items, p.name)
    if "prompt_len" in first:
        return [parse_length_only(d, where=f"{p.name}[{i}]") for i, d in enumerate(items)]
    raise TraceError(f"trace: {p}: unknown format (keys {sorted(first)[:8]})")


def _num(d: dict, key: str, where: str, *, required=True, default=None, integer=False):
    if key not in d or d[key] is None:
        if required:
            raise TraceError(f"{where}.{key}: missing")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{where}.{key}: expected a number, got {v!r}")
    if v < 0:
        raise TraceError(f"{where}.{key}: must be >= 0, got {v!r}")
    if integer and int(v) != v:
        raise TraceError(f"{where}.{key}: expected an integer, got {v!r}")
    return int(v) if integer else float(v)


def parse_agentx(d: dict, where: str = "trace") -> Trace:
    if not isinstance(d.get("requests"), list):
        raise TraceError(f"{where}.requests: missing or not a list")
    scope = d.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise TraceError(f"{where}.hash_id_scope: expected 'local' or 'global', got {scope!r}")
    block = _num(d, "block_size", where, required=False, default=64, integer=True)
    if block <= 0:
        raise TraceError(f"{where}.block_size: must be > 0")
    root, _ = _parse_session(d, "root", where, origin=0.0)
    root.system_tokens = _num(d, "system_tokens", where, required=False, default=0, integer=True)
    return Trace(trace_id=str(d.get("id", where)), root=root, block_size=block, hash_id_scope=scope)


def _parse_session(d: dict, session_id: str, where: str, origin: float):
    """Session from an AgentX requests list; returns (session, recorded end time)."""
    entries = d["requests"]
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise TraceError(f"{where}.requests[{i}]: expected an object")
    order = sorted(range(len(entries)), key=lambda i: _num(entries[i], "t", f"{where}.requests[{i}]"))
    session = Session(session_id=session_id, agent_type=d.get("subagent_type"))
    prev_end = origin  # recorded end of this session's previous turn (or its start)
    pending: list[tuple[Spawn, float]] = []  # spawned, not yet joined: (spawn, recorded end)
    turn_idx = 0
    last_end = origin
    for i in order:
        e, w = entries[i], f"{where}.requests[{i}]"
        t = _num(e, "t", w)
        if e.get("type") == "subagent":
            if not isinstance(e.get("requests"), list):
                raise TraceError(f"{w}.requests: a subagent entry needs its own requests list")
            agent_id = str(e.get("agent_id", f"agent_{i}"))
            sub, sub_end = _parse_session(e, f"{session_id}/{agent_id}", w, origin=t)
            dur = _num(e, "duration_ms", w, required=False)
            if dur is not None:
                sub_end = max(sub_end, t + dur / 1000.0)
            spawn = Spawn(agent_id=agent_id, t=t, delay_s=max(0.0, t - prev_end), session=sub)
            session.steps.append(spawn)
            if not (e.get("background") is True or e.get("status") == "background"):
                pending.append((spawn, sub_end))
            last_end = max(last_end, sub_end)
            continue
        n_in = _num(e, "in", w, integer=True)
        n_out = _num(e, "out", w, integer=True)
        if n_out < 1:
            raise TraceError(f"{w}.out: must be >= 1")
        hash_ids = e.get("hash_ids") or []
        if not isinstance(hash_ids, list):
            raise TraceError(f"{w}.hash_ids: expected a list")
        joined = [(sp, end) for sp, end in pending if end <= t]
        pending = [(sp, end) for sp, end in pending if end > t]
        ref = max([prev_end] + [end for _, end in joined])
        for sp, _ in joined:
            sp.gating = True
        think = _num(e, "think_time", w, required=False)
        if think is None:
            think = max(0.0, t - ref)
        session.steps.append(Turn(index=turn_idx, t=t, input_tokens=n_in, output_tokens=n_out,
                                  hash_ids=list(hash_ids), think_s=think,
                                  joins=[sp.agent_id for sp, _ in joined], stop=e.get("stop")))
        turn_idx += 1
        api = _num(e, "api_time", w, required=False)
        prev_end = t + (api or 0.0)
        last_end = max(last_end, prev_end)
    if turn_idx == 0:
        raise TraceError(f"{where}.requests: session {session_id!r} has no turns")
    return session, last_end


def parse_mooncake(rows: list[dict], name: str) -> list[Trace]:
    traces = []
    for i, r in enumerate(rows):
        w = f"{name}[{i}]"
        t = _num(r, "timestamp", w, required=False, default=0.0) / 1000.0
        turn = Turn(index=0, t=t, input_tokens=_num(r, "input_length", w, integer=True),
                    output_tokens=max(1, _num(r, "output_length", w, integer=True)),
                    hash_ids=list(r.get("hash_ids") or []))
        traces.append(Trace(trace_id=f"{name}:{i}", root=Session("root", [turn]),
                            block_size=512, hash_id_scope="global"))
    return traces


def parse_length_only(d: dict, where: str) -> Trace:
    prompt = _num(d, "prompt_len", where, integer=True)
    outs = d.get("out_lens")
    if not isinstance(outs, list) or not outs:
        raise TraceError(f"{where}.out_lens: expected a non-empty list")
    obs = d.get("obs_lens") or [0] * (len(outs) - 1)
    tools = d.get("tool_times") or [0.0] * (len(outs) - 1)
    if len(obs) < len(outs) - 1:
        raise TraceError(f"{where}.obs_lens: need {len(outs) - 1} entries, got {len(obs)}")
    steps, n_in, t = [], prompt, 0.0
    for k, n_out in enumerate(outs):
        think = float(tools[k - 1]) if k > 0 and k - 1 < len(tools) else 0.0
        if k > 0:
            n_in += int(outs[k - 1]) + int(obs[k - 1])
            t += think
        steps.append(Turn(index=k, t=t, input_tokens=n_in, output_tokens=max(1, int(n_out)),
                          think_s=think))
    tid = f"{d.get('group', where)}:{d.get('stream', 0)}"
    return Trace(trace_id=tid, root=Session("root", steps))
