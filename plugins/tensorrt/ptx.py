"""The `.entry` parameter list of a PTX kernel: parse it, strip Triton's scratch pointers, check it
against TensorRT's calling convention (input pointers, int32 scalars, output pointers; nothing else).

Pure text processing (no Triton, no CUDA), so a bundle's PTX can be checked anywhere.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass


class ConventionError(ValueError):
    """A kernel's PTX (or its compile) does not fit what TensorRT passes; the message names the kernel."""


@dataclass(frozen=True)
class PtxParam:
    name: str
    type: str            # the PTX state-space type: "u64", "u32", "s32", "f32", "b8", ...
    pointer: bool        # declared `.ptr` (Triton marks every pointer argument so)
    array: int | None    # element count of a `name[N]` (by-value struct) parameter, else None
    text: str            # the declaration as written, for rewriting

    @property
    def kind(self) -> str:
        return "ptr" if self.pointer else (f"{self.type}[{self.array}]" if self.array else self.type)


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(")
_PARAM = re.compile(r"^\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s*(.*?)\s*([A-Za-z_$%][\w$]*)\s*(?:\[(\d+)\])?$", re.S)


def _entry_span(ptx: str, entry: str | None) -> tuple[str, int, int]:
    """-> (entry name, start, end) of the text between the entry's parentheses."""
    found = list(_ENTRY.finditer(ptx))
    if entry is not None:
        found = [m for m in found if m.group(1) == entry]
    if len(found) != 1:
        names = [m.group(1) for m in _ENTRY.finditer(ptx)]
        want = f"entry {entry!r}" if entry else "exactly one entry"
        raise ConventionError(f"PTX: expected {want}, found {names or 'none'}")
    m = found[0]
    close = ptx.find(")", m.end())
    if close < 0:
        raise ConventionError(f"PTX entry {m.group(1)}: parameter list not closed")
    return m.group(1), m.end(), close


def entry_params(ptx: str, entry: str | None = None) -> tuple[str, list[PtxParam]]:
    """-> (entry name, its parameters in order). `entry` may be omitted when the PTX has one entry."""
    name, start, end = _entry_span(ptx, entry)
    params = []
    for raw in filter(None, (p.strip() for p in ptx[start:end].split(","))):
        m = _PARAM.match(raw)
        if m is None:
            raise ConventionError(f"PTX entry {name}: cannot parse parameter {raw!r}")
        ptype, mods, pname, arr = m.groups()
        params.append(PtxParam(pname, ptype, ".ptr" in mods.split(), int(arr) if arr else None, raw))
    return name, params


def _body(ptx: str, end: int) -> str:
    return ptx[end + 1:]


def referenced(ptx: str, entry: str, param: str) -> bool:
    """Whether any instruction after the entry's parameter list names `param`."""
    _, _, end = _entry_span(ptx, entry)
    return re.search(r"(?<![\w$])" + re.escape(param) + r"(?![\w$])", _body(ptx, end)) is not None


def strip_scratch(ptx: str, entry: str, count: int = 2) -> str:
    """PTX without the `count` trailing pointer parameters Triton appends (global, profile scratch).
    Refuses (ConventionError) unless they are pointers the body never names: dropping an unused
    declaration leaves every instruction as it was, and TensorRT passes nothing in those slots."""
    name, params = entry_params(ptx, entry)
    if len(params) < count:
        raise ConventionError(f"{name}: {len(params)} parameters, fewer than Triton's {count} scratch pointers")
    tail = params[len(params) - count:]
    for p in tail:
        if not p.pointer or p.type != "u64":
            raise ConventionError(f"{name}: trailing parameter {p.name} is .{p.kind}, not a Triton scratch pointer")
        if referenced(ptx, name, p.name):
            raise ConventionError(f"{name}: the kernel uses scratch parameter {p.name}; TensorRT cannot pass it")
    _, start, end = _entry_span(ptx, name)
    kept = params[:len(params) - count]
    inner = "\n" + ",\n".join("\t" + p.text for p in kept) + "\n" if kept else ""
    return ptx[:start] + inner + ptx[end:]


SCALAR_TYPES = ("u32", "s32", "b32")   # how an int32 SymExpr arrives: 4 bytes; Triton declares i32 as .u32


def check_entry(ptx: str, entry: str, inputs: int, scalars: int, outputs: int,
                names: list[str] | None = None) -> list[PtxParam]:
    """Check that `entry` declares exactly TensorRT's arguments: `inputs` pointers, `scalars` 32-bit
    integers, `outputs` pointers, nothing before, between or after. `names` (the kernel's argument
    names in that order) only make the error messages readable. -> the parameters."""
    name, params = entry_params(ptx, entry)
    want = ["ptr"] * inputs + ["i32"] * scalars + ["ptr"] * outputs
    names = names or [f"#{i}" for i in range(len(want))]
    role = ["input"] * inputs + ["int32 scalar"] * scalars + ["output"] * outputs

    def label(i: int) -> str:
        return f"parameter {i} ({names[i]}, {role[i]})" if i < len(want) else f"parameter {i}"

    for i, p in enumerate(params):
        if p.type.startswith("f"):
            what = names[i] if i < len(names) else p.name
            raise ConventionError(f"{name}: parameter {i} ({what}) is .{p.type}: TensorRT passes no float "
                                  f"scalars; make it a constexpr or an input tensor")
    if len(params) != len(want):
        extra = [p.name for p in params[len(want):]]
        hint = "; Triton's scratch pointers still declared (strip_scratch)" if (
            len(params) == len(want) + 2 and all(p.pointer for p in params[len(want):])) else ""
        raise ConventionError(f"{name}: PTX entry declares {len(params)} parameters, TensorRT passes {len(want)} "
                              f"({inputs} inputs, {scalars} int32 scalars, {outputs} outputs)"
                              + (f"; extra: {', '.join(extra)}" if extra else "") + hint)
    for i, (p, w) in enumerate(zip(params, want)):
        if w == "ptr" and not (p.pointer and p.type == "u64"):
            raise ConventionError(f"{name}: {label(i)} is .{p.kind}, TensorRT passes a 64-bit pointer")
        if w == "i32" and (p.pointer or p.array or p.type not in SCALAR_TYPES):
            raise ConventionError(f"{name}: {label(i)} is .{p.kind}, TensorRT passes a 32-bit integer")
    return params


_NOT_INSTRUCTIONS = ("//", ".", "$", "{", "}", ")", "ld.param")


def instructions(ptx: str, entry: str) -> Counter:
    """Opcode counts of the entry's body without its parameter loads: two compiles of the same code
    that differ only in their parameter lists have equal counts (labels, directives, debug sections
    and register declarations are skipped)."""
    _, _, end = _entry_span(ptx, entry)
    counts: Counter = Counter()
    for line in _body(ptx, end).splitlines():
        line = line.strip()
        if line and not line.startswith(_NOT_INSTRUCTIONS) and not line.endswith(":"):
            words = line.split()
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]   # predicated
            counts[op.rstrip(";")] += 1
    return counts
