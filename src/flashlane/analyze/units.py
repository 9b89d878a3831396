"""Parsing and printing of sizes: token counts (8k, 1m), bytes, FLOPs, parameter counts."""

from __future__ import annotations

_SUFFIX = {"k": 1024, "m": 1024 ** 2}


def parse_tokens(text: str, what: str = "--context") -> int:
    """'8k' -> 8192, '1m' -> 1048576, '3000' -> 3000 (k = 1024, m = 1024**2)."""
    s = str(text).strip().lower()
    mult = 1
    if s and s[-1] in _SUFFIX:
        mult, s = _SUFFIX[s[-1]], s[:-1]
    try:
        value = float(s) * mult if "." in s else int(s) * mult
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a token count (use e.g. 8192, 8k or 1m)") from None
    if value != int(value) or value <= 0:
        raise ValueError(f"{what}: {text!r} must be a positive whole number of tokens")
    return int(value)


def parse_token_list(text: str, what: str = "--context") -> list[int]:
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{what}: empty list")
    return [parse_tokens(p, what) for p in parts]


def tokens_label(n: int) -> str:
    for suffix, mult in (("m", 1024 ** 2), ("k", 1024)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def _scaled(value: float, steps: list[tuple[float, str]], digits: int = 3) -> str:
    for mult, unit in steps:
        if abs(value) >= mult:
            return f"{value / mult:.{digits}g} {unit}".rstrip()
    return f"{value:.{digits}g} {steps[-1][1] if steps[-1][0] == 1 else ''}".rstrip()


def fmt_params(n: float) -> str:
    return _scaled(n, [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")], 4)


def fmt_bytes(n: float) -> str:
    return _scaled(n, [(1024 ** 4, "TiB"), (1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB"), (1, "B")], 4)


def fmt_flops(n: float) -> str:
    steps = [(1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "KFLOP"), (1, "FLOP")]
    return _scaled(n, steps, 4)


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.3g}x"


def fmt_number(v: float) -> str:
    """Plain counts and rates: thousands separators when large, 3 significant digits when small."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_usd(v: float) -> str:
    return f"${v:,.2f}" if abs(v) >= 100 else f"${v:.3g}"
