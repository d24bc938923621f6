"""TEST DOUBLE of `python -m sglang.srt.weight_cache.daemon`: exists only to test hostd's orchestration.

Not SGLang and loads nothing. Its parser is SGLang 0.5.23's own flag set
(tests/upstream/flags/): it rejects what SGLang rejects. It refuses
expandable_segments:True as upstream does. As upstream, it is a launcher plus
one process per rank (per visible GPU, UUIDs faked from HOSTD_TEST_GPU_UUID):
each rank sets PR_SET_PDEATHSIG to the launcher, binds the socket named by
SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE, then writes the .ready file named by
SGLANG_WEIGHT_CACHE_READY_TEMPLATE (pid= the rank's, config= a Python dict
literal). Neither installs a SIGTERM handler: SIGTERM kills the launcher at
once, the ranks die with it, and their .sock/.ready files are left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from sglang import _common
from sglang._common import double_http, paths_for

PR_SET_PDEATHSIG = 1


def build_parser():
    return _common.build_parser("sglang.srt.weight_cache.daemon", "weight_cache.daemon")


def rank(args, rank_index: int, uuid: str) -> int:
    """One rank (--tp-rank given): dies with the launcher (PR_SET_PDEATHSIG),
    binds its socket, then writes its .ready file with its own pid."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the prctl
        return 1
    time.sleep(float(os.environ.get("HOSTD_TEST_LOAD_SECONDS", "0.2")))
    sock_path, ready_path = paths_for(uuid)
    old = os.umask(0o177)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    os.umask(old)
    sock.listen(1)
    threading.Thread(target=double_http.accept_and_close, args=(sock,), daemon=True).start()
    config = {"model_path": args.model_path, "tp_size": args.tp_size, "tp_rank": rank_index, "dtype": args.dtype}
    ready_path.write_text(f"pid={os.getpid()}\nconfig={config!r}\n")  # a Python dict literal, as upstream
    # No SIGTERM handler, as upstream: the .sock/.ready files outlive it.
    while True:
        time.sleep(3600)


def main() -> int:
    args = build_parser().parse_args()
    args.tp_size = int(args.tp_size or 1)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
            sys.exit(f"RuntimeError: {name} has expandable_segments:True; the weight cache cannot share such memory")
    uuids = double_http.gpu_uuids()
    if len(uuids) != args.tp_size:
        sys.exit(f"double: {len(uuids)} visible GPU(s) for --tp-size {args.tp_size}")
    if args.tp_rank is not None:
        index = int(args.tp_rank)
        return rank(args, index, uuids[index])
    # The launcher: one process per rank; no SIGTERM handler and no
    # parent-death signal of its own (only the ranks set one, to it).
    ranks = [subprocess.Popen([sys.executable, "-m", "sglang.srt.weight_cache.daemon", *sys.argv[1:],
                               "--tp-rank", str(i), "--gpu-id", str(i)]) for i in range(len(uuids))]
    double_http.log(f"weight cache daemon launched {len(ranks)} rank(s)")
    while True:
        for proc in ranks:
            if proc.poll() is not None:
                for other in ranks:
                    other.kill()
                raise RuntimeError(f"Weight cache daemon (pid={proc.pid}) exited with code {proc.returncode}; "
                                   "terminated the remaining daemons.")
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
