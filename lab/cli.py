"""What every script shares, without torch: one-line failures and files written atomically.

Every script reports bad input the same way: one line on stderr, `script.py: error: what was wrong;
what to do`, and exit code 2, never a traceback. Every file a script writes appears whole or not at
all (atomic_path), so no failure, Ctrl-C or full disk ever leaves half a checkpoint or replaces a
good one by a broken one.
"""

import argparse
import contextlib
import glob
import json
import os
import re
import sys

# --------------------------------------------------------------------------------------------------
# One-line failures


def one_line(text):
    """Any message as one line (library messages can span many)."""
    return " ".join(str(text).split())


def fail(prog, message):
    """Bad input: one actionable line on stderr and exit code 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


def parse_json(data, where, fix):
    """data (bytes or str) -> its JSON value. Every failure is one ValueError line, "{where}: what
    was wrong; {fix}": bytes that are not UTF-8, bad JSON, and what json.loads raises beyond
    ValueError for a value nested too deeply (RecursionError) or too large (MemoryError)."""
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except UnicodeDecodeError as e:
        what = f"not UTF-8 text (byte {e.start:,})"
    except json.JSONDecodeError as e:
        what = f"not valid JSON ({e.msg}, line {e.lineno}, column {e.colno})"
    except RecursionError:
        what = "nested too deeply to read (more levels than Python's recursion limit)"
    except MemoryError:
        what = f"too large to read as JSON ({len(data):,} bytes)"
    except ValueError as e:  # an integer of more digits than Python converts
        what = f"not valid JSON ({str(e).split(';')[0]})"  # without Python's advice
    raise ValueError(f"{where}: {what}; {fix}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag gives one line (not the usage block, then the error) and exit code
    2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


# --------------------------------------------------------------------------------------------------
# Files: written atomically, checked up front


@contextlib.contextmanager
def atomic_path(path):
    """`with atomic_path(path) as tmp:` write the file at tmp; at the end of the block it replaces
    path (os.replace), so a reader never sees half a file and an interrupted or failed write leaves
    the old one whole. On any failure the half-written tmp is removed (a full disk is not kept
    full). The process id in tmp keeps concurrent writers (DDP ranks) apart, and lets
    remove_stale_temps tell a dead writer's leftovers."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_atomic(path, data):
    """Write bytes to path atomically (atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def remove_stale_temps(folder):
    """Remove the temp files (name.tmpPID) that writers killed mid-write left in folder (their
    process is gone)."""
    for tmp in glob.glob(os.path.join(glob.escape(folder), "*.tmp*")):
        match = re.search(r"\.tmp(\d+)$", tmp)
        if match and not pid_alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.remove(tmp)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def save_figure(fig, path):
    """Write a matplotlib figure as a PNG at path (atomically), and close it."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def check_output_file(path, flag):
    """Refuse, before any work is done, an output file that could not be written: an empty name, a
    directory, or a folder that cannot be created or written to. Raises ValueError naming the flag.
    """
    if not path:
        raise ValueError(f"{flag} is empty; give a file name")
    if os.path.isdir(path):
        raise ValueError(f"{flag}={path} is a directory; give a file name")
    check_output_dir(os.path.dirname(path) or ".", flag)


def check_output_dir(folder, flag):
    """The folder exists (or can be made) and a file can be created in it; else ValueError naming
    the flag."""
    if not folder:
        raise ValueError(f"{flag} is empty; give a folder")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{flag}={folder} is a file, not a folder; give another path")
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{flag}: cannot write in {folder} ({e.strerror}); "
                         f"give a writable path") from None
