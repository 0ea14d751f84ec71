"""Reports mbarrier arrives issued while shared-memory loads are in flight.

A consumer that reads a TMA-filled buffer with ld.shared (LDS / LDSM) and
then releases it with an mbarrier arrive must have those reads back in
registers before the arrive: ptxas does not make the arrive wait for them,
and a TMA write that the release lets in can land first (the ws forward's
float32 bias at D = 256 read the next block's bias that way; NOTES.md).

Reads the SASS of objects or cubins (cuobjdump -sass), walks each function
in address order with the scoreboards of the control bits: an LDS / LDSM
sets its write scoreboard, an instruction that waits on it clears it, and an
SYNCS.ARRIVE with a load's scoreboard still set is reported; a MEMBAR
(what fence.proxy.async becomes) waits for every load in flight. Straight-line
order only (a branch target does not merge states), so it can miss a hazard
across a branch and report one whose load a branch took away; read each
report in the SASS.

Usage: python3 tests/gpu/sass_release_check.py OBJ... [--filter REGEX]
(tests/test_sass.py runs it on the installed extension.)
Exit status 1 when something is reported.
"""
import argparse
import re
import subprocess
import sys

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/")
HI = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/")
LOADS = ("LDS", "LDSM")


def control(hi):
    """The control bits of an instruction's high word (sm_70 and later)."""
    c = (hi >> 41) & 0x1FFFFF
    return {"wr": (c >> 5) & 7, "rd": (c >> 8) & 7, "wait": (c >> 11) & 0x3F}


def instructions(text):
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = INSTR.search(line)
        if m and i + 1 < len(lines):
            h = HI.search(lines[i + 1])
            if h:
                yield m.group(1), m.group(2), control(int(h.group(1), 16))


def opcode(text):
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def check_function(name, body):
    pending = {}  # scoreboard -> (address, instruction) of a load in flight
    reports = []
    for addr, text, c in instructions(body):
        for sb in list(pending):
            if c["wait"] >> sb & 1:
                del pending[sb]
        op = opcode(text)
        if op.startswith("MEMBAR"):
            pending.clear()
        if op.startswith("SYNCS.ARRIVE") and pending:
            reports.append((addr, text, sorted(pending.values())))
        if op.split(".")[0] in LOADS and c["wr"] != 7:
            pending[c["wr"]] = (addr, text)
    return reports


def check_object(obj, cuobjdump="cuobjdump", name_filter=".", arch=None):
    """[(function, address, instruction, [(address, load) in flight])] of obj."""
    cmd = [cuobjdump, "-sass", obj] + (["-arch", arch] if arch else [])
    sass = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    reports = []
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        if re.search(name_filter, name):
            reports += [(name, *r) for r in check_function(name, part)]
    return reports


def format_report(name, addr, text, loads):
    return f"{name}\n  {addr}: {text}\n" + "".join(f"    in flight: {a}: {t}\n" for a, t in loads)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("objects", nargs="+")
    ap.add_argument("--filter", default=".", help="regex on the mangled function name")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    args = ap.parse_args()
    found = 0
    for obj in args.objects:
        for report in check_object(obj, args.cuobjdump, args.filter):
            found += 1
            print(f"{obj}: " + format_report(*report))
    print(f"{found} arrive(s) with shared loads in flight")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
