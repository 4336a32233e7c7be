"""The bad-input check the cli tests share: a command exits 2 with one stderr line, `moex: error: ...`, naming
each of `words`."""
import subprocess


def expect_error(failures, name, cmd, *words):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    ok = r.returncode == 2 and len(lines) == 1 and lines[0].startswith("moex: error:") and all(
        w in lines[0] for w in words)
    print(("ok   " if ok else "FAIL ") + name + ": " + (lines[0] if lines else f"(no stderr, exit {r.returncode})"))
    if not ok:
        failures.append(f"{name}: exit {r.returncode}, stderr {r.stderr!r}, wanted {words}")
