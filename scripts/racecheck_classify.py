"""Sort compute-sanitizer racecheck reports into Triton's warp-specialize lowering and everything else (issue 10).

    python scripts/racecheck_classify.py OUTDIR/racecheck-gluonbwd.log [more.log ...] [--json out.json]

Racecheck flags the words that Triton's ``gl.warp_specialize`` lowering keeps in shared memory (the state word
that tells each worker warp which partition to run, and the capture slots), although every flagged write/read pair
is ordered by a CTA-wide ``barrier.sync 1`` (docs/racecheck-gluon.md: every PC of the session-5 logs matched in
the SASS).  The ``wsprobe`` control kernel (scripts/ws_probe.py: no mxattn code, one mbarrier, one capture) gets
the same reports.  Those accesses carry no line of their own in the debug info: the compiler attributes them to
the kernel's ``def`` line (the prologue: workers read the state word) or to the lines around the
``gl.warp_specialize(...)`` call (the default warps write it on entry and exit).

Rule: a hazard is "ws_lowering" when *both* of its accesses are attributed to such a line of a file that calls
``gl.warp_specialize``: a ``def`` line, the call's own lines, the statement just before and just after the call,
and the header of the block the call sits in (``if SPLIT:``; for an ``else:``, its ``if``).
Anything else (an access on a line of a kernel body: a tile, a barrier array, scratch) is "other", and the script
exits 1.  The rule can only move a report to "other" by mistake, never hide one that touches kernel code.
Source files are looked up by name under mxattn/ and scripts/ of this checkout (the GPU run's tree).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_HAZARD = re.compile(r"Error: Potential (RAW|WAR|WAW) hazard detected at __shared__ (0x[0-9a-f]+)")
_ACCESS = re.compile(r"^=+\s+(Write|Read) Thread \([0-9,]+\) at (\S+?)\+0x[0-9a-f]+ in (\S+):(\d+)")
_SUMMARY = re.compile(r"Error: Race reported between (Write|Read) access at (\S+?)\+0x[0-9a-f]+ in (\S+):(\d+)\s+=*\s*"
                      r"and (Write|Read) access at (\S+?)\+0x[0-9a-f]+ in (\S+):(\d+) \[(\d+) hazards?\]")
_TOTAL = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def ws_lines(path: Path) -> set[int]:
    """1-based lines of ``path`` that Triton's warp-specialize lowering is attributed to (module docstring)."""
    text = path.read_text().splitlines()
    if not any("gl.warp_specialize(" in line for line in text):
        return set()
    lines = {i + 1 for i, line in enumerate(text) if line.lstrip().startswith("def ")}
    for i, line in enumerate(text):
        if "gl.warp_specialize(" not in line:
            continue
        j, depth, started = i, 0, False  # the line of the call's closing parenthesis
        col = line.index("gl.warp_specialize(")
        while j < len(text):
            for ch in text[j][col if j == i else 0:]:
                depth += (ch == "(") - (ch == ")")
                started |= ch == "("
            if started and depth <= 0:
                break
            j += 1
        first = i - 1  # the statement before (skipping blank lines) ...
        while first >= 0 and not text[first].strip():
            first -= 1
        indent = len(line) - len(line.lstrip())
        k = first  # ... and the header of the block the call sits in (`if SPLIT:`), up to its `if` for an `else:`
        while k >= 0 and (not text[k].strip() or len(text[k]) - len(text[k].lstrip()) >= indent):
            k -= 1
        if k >= 0 and re.match(r"(if|elif|else|for|while|with)\b.*:\s*(#.*)?$", text[k].strip()):
            first = min(first, k)
            if text[k].strip() == "else:":
                head = len(text[k]) - len(text[k].lstrip())
                while k >= 0 and not (len(text[k]) - len(text[k].lstrip()) == head and text[k].lstrip().startswith("if ")):
                    k -= 1
                first = min(first, max(k, 0))
        nxt = j + 1  # ... and the statement after the call
        while nxt < len(text) and not text[nxt].strip():
            nxt += 1
        lines.update(range(first + 1, nxt + 2))
    return lines


class _Sources:
    def __init__(self, roots):
        self.roots = roots
        self.cache: dict[str, set[int] | None] = {}

    def is_ws(self, name: str, line: int) -> bool:
        if name not in self.cache:
            hits = [p for r in self.roots for p in r.rglob(name)]
            self.cache[name] = ws_lines(hits[0]) if hits else None
        ws = self.cache[name]
        return ws is not None and line in ws


def classify(log_text: str, sources: _Sources) -> dict:
    """Counts of one racecheck log: hazards and per-launch summaries by class, and the examples of "other"."""
    hazards, summaries, other = Counter(), Counter(), []
    lines = log_text.splitlines()
    i = 0
    while i < len(lines):
        m = _HAZARD.search(lines[i])
        if m:
            acc = [a for a in (_ACCESS.match(x) for x in lines[i + 1:i + 3]) if a]
            ok = len(acc) == 2 and all(sources.is_ws(a.group(3), int(a.group(4))) for a in acc)
            cls = "ws_lowering" if ok else "other"
            hazards[cls] += 1
            if not ok and len(other) < 20:
                other.append(" | ".join([lines[i].split("Error: ")[-1]] + [x.strip("= ") for x in lines[i + 1:i + 3]]))
            i += 3
            continue
        s = _SUMMARY.search(lines[i] + " " + lines[i + 1]) if i + 1 < len(lines) else None
        if s:
            ok = sources.is_ws(s.group(3), int(s.group(4))) and sources.is_ws(s.group(7), int(s.group(8)))
            summaries["ws_lowering" if ok else "other"] += int(s.group(9))
            if not ok and len(other) < 20:
                other.append(lines[i].split("Error: ")[-1])
        i += 1
    total = _TOTAL.search(log_text)
    return {
        "hazards": dict(hazards), "summarised_hazards": dict(summaries), "other_examples": other,
        "racecheck_summary": {"displayed": int(total.group(1)), "errors": int(total.group(2))} if total else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--json", type=Path, help="write the counts here")
    a = p.parse_args(argv)
    sources = _Sources([ROOT / "mxattn", ROOT / "scripts"])
    result, bad = {}, False
    for log in a.logs:
        r = classify(log.read_text(errors="replace"), sources)
        result[str(log)] = r
        n_ws, n_other = r["hazards"].get("ws_lowering", 0), r["hazards"].get("other", 0)
        s = r["racecheck_summary"]
        shown_all = s is None or s["displayed"] == s["errors"]
        bad |= n_other > 0 or r["summarised_hazards"].get("other", 0) > 0 or not shown_all
        verdict = ("only Triton warp-specialize lowering" if n_other == 0 and shown_all else
                   "NOT all shown (raise --print-limit)" if not shown_all else "OTHER hazards")
        print(f"{log.name}: {n_ws} hazards on warp-specialize lowering lines, {n_other} elsewhere; "
              f"racecheck {s}: {verdict}")
        for ex in r["other_examples"]:
            print("   other:", ex)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
