#!/usr/bin/env python3
"""An interrupted `moex gen-model --force` (or convert) leaves the old output and nothing else.

Drives the real binary: a small model is being written over a tiny one when the test sends a signal. The
writer is stopped (SIGSTOP) once a shard file exists in its staging folder beside --out, signalled, then
continued, so the signal lands mid-write however fast the machine is. Checks, against the files on disk:
  * SIGINT / SIGTERM: the process dies of that signal (shell status 130 / 143) with one line on stderr, the
    staging folder is gone and --out holds the old model byte for byte;
  * SIGKILL: the staging folder stays (nothing can remove it then); the next run writing the same --out
    removes it and says so, and leaves alone a look-alike folder that no run of moex provably made;
  * a run does not touch the staging folder of a concurrent run writing the same --out, which completes;
  * the writers of one file (here convert) stage the same way: SIGTERM leaves the old file and no folder.
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

from check_files import FAILURES, check, moex_and_fresh_workdir, snapshot


def main():
    moex, work = moex_and_fresh_workdir(__doc__)
    out = os.path.join(work, "model")
    subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "1", "--out", out], check=True,
                   capture_output=True)
    old = snapshot(out)
    # 80 MB in 21 shards on one thread: 0.3 s on a quiet machine, time enough to see the first shard.
    slow = [moex, "gen-model", "--preset", "small", "--layers", "12", "--threads", "1", "--seed", "2",
            "--max-shard-size", "4MB", "--out", out, "--force"]

    def staging(target=out):
        return glob.glob(target + ".*-tmp-*")

    def stopped(pid):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "Tt"

    def catch_writing(argv, target, needle):
        """A run, stopped (SIGSTOP) with a file named like `needle` in its staging folder: (process, folder)."""
        before = set(staging(target))
        victim = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while time.time() < deadline and victim.poll() is None:
            for folder in set(staging(target)) - before:
                try:
                    if any(needle in n for n in os.listdir(folder)):
                        victim.send_signal(signal.SIGSTOP)
                        while victim.poll() is None and not stopped(victim.pid):
                            time.sleep(0.001)
                        if victim.poll() is None and os.path.isdir(folder):
                            return victim, folder
                except OSError:  # gone, or a file (a writer that does not stage in a folder)
                    pass
            time.sleep(0.001)
        victim.kill()
        victim.communicate()
        return None, None

    def start_writing(argv=slow, target=out, needle="safetensors"):
        """catch_writing, given a few tries: on a loaded machine a run may finish between two looks."""
        for _ in range(5):
            victim, folder = catch_writing(argv, target, needle)
            if victim is not None:
                return victim, folder
        return None, None

    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        victim, folder = start_writing()
        if not check(victim is not None, f"{sig.name}: gen-model --force was caught writing its staging folder"):
            continue
        victim.send_signal(sig)
        victim.send_signal(signal.SIGCONT)
        try:
            _, err = victim.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            victim.kill()
            _, err = victim.communicate()
        lines = [l for l in err.splitlines() if l.strip()]
        check(victim.returncode == -sig, f"{sig.name}: the process dies of the signal, shell status {status} "
                                         f"(returncode {victim.returncode})")
        check(len(lines) == 1 and sig.name in err and folder in err,
              f"{sig.name}: one line naming the signal and the removed folder (stderr {err.strip()!r})")
        check(not os.path.exists(folder) and not staging(), f"{sig.name}: no staging folder is left ({staging()})")
        check(snapshot(out) == old, f"{sig.name}: --out holds the old model byte for byte")

    # SIGKILL: the folder stays; the next run removes it, and only what it can prove a dead run's.
    victim, killed = start_writing()
    if check(victim is not None, "SIGKILL: gen-model --force was caught writing its staging folder"):
        victim.kill()
        victim.communicate()
        check(os.path.isdir(killed), "SIGKILL: the staging folder is left (nothing can remove it then)")
        dead_pid = int(open("/proc/sys/kernel/pid_max").read())  # pids are below it: never a live process
        lookalike = f"{out}.gen-model-tmp-{dead_pid}-AbC123"  # named as a dead run's, but no marker
        os.makedirs(lookalike)
        with open(os.path.join(lookalike, "notes.txt"), "w") as f:
            f.write("the user's own file\n")
        # A symlink named as the killed run's folder, to a copy of it (marker included) elsewhere: not followed.
        copy = os.path.join(work, "copy")
        shutil.copytree(killed, copy, symlinks=True)
        copied = sorted(os.listdir(copy))
        link = killed[:-6] + "Sym123"
        os.symlink(copy, link)
        r = subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "3", "--out", out, "--force"],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"the next run succeeds (exit {r.returncode}, stderr {r.stderr.strip()!r})")
        check(not os.path.exists(killed) and "removed " + killed in r.stderr,
              f"the next run removes the killed run's staging folder and says so (stderr {r.stderr.strip()!r})")
        check(os.path.exists(os.path.join(lookalike, "notes.txt")) and lookalike in r.stderr,
              "a look-alike folder without moex's marker is named but left as it is")
        check(os.path.islink(link) and sorted(os.listdir(copy)) == copied and ".moex-unfinished" in copied,
              f"a symlink named as a dead run's staging folder is not followed ({copied})")
        shutil.rmtree(lookalike)
        os.remove(link)

    # A concurrent run's staging folder is not a killed run's.
    victim, folder = start_writing()
    if check(victim is not None, "concurrent: gen-model --force was caught writing its staging folder"):
        r = subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "4", "--out", out, "--force"],
                           capture_output=True, text=True)
        present = os.path.isdir(folder)
        victim.send_signal(signal.SIGCONT)
        _, err = victim.communicate(timeout=120)
        check(r.returncode == 0 and folder not in r.stderr, f"a run beside a running one succeeds and leaves its "
                                                            f"folder unnamed (stderr {r.stderr.strip()!r})")
        check(present, "the running one's staging folder is still there after the other run")
        check(victim.returncode == 0,
              f"and the running one completes (exit {victim.returncode}, stderr {err.strip()!r})")
        check(not staging(), f"no staging folder is left ({staging()})")

    # The writers of one file stage the same way: convert's .gguf, interrupted mid-write.
    gguf = os.path.join(work, "model.gguf")
    subprocess.run([moex, "convert", "--model", out, "--out", gguf], check=True, capture_output=True)
    old_gguf = open(gguf, "rb").read()
    victim, folder = start_writing([moex, "convert", "--model", out, "--out", gguf, "--type", "q4_K", "--force"],
                                   gguf, "")
    if check(victim is not None, "convert --force was caught with its staging folder"):
        victim.send_signal(signal.SIGTERM)
        victim.send_signal(signal.SIGCONT)
        _, err = victim.communicate(timeout=60)
        check(victim.returncode == -signal.SIGTERM and folder in err and not staging(gguf),
              f"convert: SIGTERM removes its staging folder (returncode {victim.returncode}, stderr {err.strip()!r})")
        check(open(gguf, "rb").read() == old_gguf, "convert: --out holds the old .gguf byte for byte")

    print(f"{len(FAILURES)} failed" if FAILURES else "all passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
