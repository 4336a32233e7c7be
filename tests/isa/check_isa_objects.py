"""Disassembles every object of the moex_* libraries and checks its instructions against its ISA suffix.

  no suffix (baseline x86-64)  no ymm/zmm/k registers, no AVX-512 / BF16 / VNNI / AMX instructions
  *_avx2.cc                    AVX2 + FMA + F16C (ymm); no zmm/k registers, BF16, VNNI or AMX
  *_avx512.cc                  AVX-512 F/BW/VL/DQ allowed; no BF16, VNNI or AMX instructions
  *_avx512bf16.cc              + BF16;  no VNNI, AMX
  *_avx512bf16vbmi.cc          + BF16 and VBMI (vpermt2b);  no VNNI, AMX
  *_avx512vnni.cc              + VNNI;  no BF16, AMX
  *_amx.cc                     anything
The families are recognised by mnemonic, so a flag added to the wrong file shows up as soon as the
compiler uses it (GCC emits vpdpbusd / vdpbf16ps for plain loops when allowed to).
The compile flags are checked too (compile_commands.json): each file gets exactly its suffix's -m flags,
so an instruction set is not merely unused today but unavailable to the compiler.
Functions GCC cloned per ISA with __attribute__((target_clones)) (named f.avx2, f.avx512f) are
skipped: GCC's own resolver picks them from the CPU's features (comm/codec.cc uses that).
"""
import json
import pathlib
import re
import subprocess
import sys

BF16 = re.compile(r"\b(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)\b")
VNNI = re.compile(r"\b(vpdpbusds?|vpdpwssds?)\b")
AMX = re.compile(r"\b(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|tilerelease|tdpb[a-z]+)\b")
WIDE = re.compile(r"%(ymm|zmm)\d+|%k[0-7]\b")
AVX512 = re.compile(r"%zmm\d+|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b")  # zmm, mask or EVEX-only registers
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$", re.M)
CLONE = re.compile(r"\.(avx\w*|sse\w*|arch_\w+)(\.\d+)?$")


def checked_text(disassembly: str) -> str:
    """The disassembly without the bodies of target_clones clones."""
    parts, keep, last = [], True, 0
    for m in FUNCTION.finditer(disassembly):
        if keep:
            parts.append(disassembly[last:m.start()])
        keep, last = not CLONE.search(m.group(1)), m.start()
    if keep:
        parts.append(disassembly[last:])
    return "".join(parts)

ALLOWED = {  # suffix -> families that must not appear
    "": [("BF16", BF16), ("VNNI", VNNI), ("AMX", AMX), ("AVX/AVX-512 registers", WIDE)],
    "avx2": [("AVX-512 registers", AVX512), ("BF16", BF16), ("VNNI", VNNI), ("AMX", AMX)],
    "avx512": [("BF16", BF16), ("VNNI", VNNI), ("AMX", AMX)],
    "avx512bf16": [("VNNI", VNNI), ("AMX", AMX)],
    "avx512bf16vbmi": [("VNNI", VNNI), ("AMX", AMX)],
    "avx512vnni": [("BF16", BF16), ("AMX", AMX)],
    "amx": [],
}


def suffix_of(obj: pathlib.Path) -> str:
    m = re.search(r"_(avx2|avx512|avx512bf16|avx512bf16vbmi|avx512vnni|amx)\.cc\.o$", obj.name)
    return m.group(1) if m else ""


FLAGS = {  # suffix -> the ISA extensions beyond AVX-512 F/BW/VL/DQ its files are compiled with (avx2: none of them)
    "avx2": set(),
    "avx512": set(),
    "avx512bf16": {"-mavx512bf16"},
    "avx512bf16vbmi": {"-mavx512bf16", "-mavx512vbmi"},
    "avx512vnni": {"-mavx512vnni"},
    "amx": {"-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"},
}
EXTENSIONS = {"-mavx512bf16", "-mavx512vbmi", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"}


def check_flags(build: pathlib.Path) -> list:
    failures = []
    for entry in json.loads((build / "compile_commands.json").read_text()):
        src = entry["file"]
        if "/src/moex/" not in src:
            continue
        flags = set(a for a in entry.get("command", " ".join(entry.get("arguments", []))).split() if a.startswith("-m"))
        m = re.search(r"_(avx2|avx512|avx512bf16|avx512bf16vbmi|avx512vnni|amx)\.cc$", src)
        if not m:
            if any(f.startswith("-mavx") or f.startswith("-mamx") for f in flags):
                failures.append(f"{src}: baseline file compiled with {sorted(flags)}")
            continue
        if m.group(1) == "avx2":
            if not {"-mavx2", "-mfma", "-mf16c"} <= flags or any(f.startswith("-mavx512") or f.startswith("-mamx") for f in flags):
                failures.append(f"{src}: 'avx2' file compiled with {sorted(flags)} (expected -mavx2 -mfma -mf16c, no AVX-512)")
            continue
        if "-mavx512f" not in flags or flags & EXTENSIONS != FLAGS[m.group(1)]:
            failures.append(f"{src}: '{m.group(1)}' file compiled with {sorted(flags & EXTENSIONS) or 'no extensions'}"
                            f" (expected {sorted(FLAGS[m.group(1)]) or 'none'} beyond AVX-512)")
    return failures


def main() -> int:
    build = pathlib.Path(sys.argv[1])
    root = build / "CMakeFiles"
    objects = sorted(p for p in root.glob("moex_*.dir/**/*.o"))
    if not objects:
        print(f"no objects under {root}/moex_*.dir: build first")
        return 1
    failures = check_flags(build)
    checked = {k: 0 for k in ALLOWED}
    for obj in objects:
        suffix = suffix_of(obj)
        in_x86 = "/x86/" in str(obj)
        if in_x86 and not suffix:
            failures.append(f"{obj}: in an x86/ folder without an ISA suffix")
            continue
        text = checked_text(subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                                           capture_output=True, text=True).stdout)
        checked[suffix] += 1
        for name, pattern in ALLOWED[suffix]:
            hit = pattern.search(text)
            if hit:
                line = text[text.rfind("\n", 0, hit.start()) + 1:text.find("\n", hit.end())].strip()
                failures.append(f"{obj.name}: {name} instruction in a '{suffix or 'baseline'}' file: {line}")
    print("objects checked per suffix:", checked)
    for f in failures:
        print("FAIL", f)
    # The rule must have seen each kind the tree has, or the check proves nothing.
    if checked["avx512"] == 0 or checked["avx512bf16"] == 0 or checked["avx512vnni"] == 0 or checked[""] == 0:
        print("FAIL: expected baseline, avx512, avx512bf16 and avx512vnni objects")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
