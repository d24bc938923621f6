"""TEST DOUBLE of `python -m sglang.srt.weight_cache.daemon`: exists only to test hostd's orchestration.

Not SGLang and loads nothing. Its parser is SGLang 0.5.23's own flag set
(tests/upstream/flags/): it rejects what SGLang rejects. It refuses expandable_segments:True as upstream does, and
for each visible GPU (UUIDs faked from HOSTD_TEST_GPU_UUID) binds the socket
named by SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE and then writes the .ready file
(pid=, config=) named by SGLANG_WEIGHT_CACHE_READY_TEMPLATE. Like upstream it
sets PR_SET_PDEATHSIG, so it dies with its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time

from sglang import _common
from sglang._common import double_http, paths_for

PR_SET_PDEATHSIG = 1


def build_parser():
    return _common.build_parser("sglang.srt.weight_cache.daemon", "weight_cache.daemon")


def main() -> int:
    args = build_parser().parse_args()
    args.tp_size = int(args.tp_size or 1)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
            sys.exit(f"RuntimeError: {name} has expandable_segments:True; the weight cache cannot share such memory")
    uuids = double_http.gpu_uuids()
    if len(uuids) != args.tp_size:
        sys.exit(f"double: {len(uuids)} visible GPU(s) for --tp-size {args.tp_size}")
    time.sleep(float(os.environ.get("HOSTD_TEST_LOAD_SECONDS", "0.2")))
    made = []
    for rank, uuid in enumerate(uuids):
        sock_path, ready_path = paths_for(uuid)
        old = os.umask(0o177)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(sock_path))
        os.umask(old)
        sock.listen(1)
        threading.Thread(target=double_http.accept_and_close, args=(sock,), daemon=True).start()
        config = {"model_path": args.model_path, "tp_size": args.tp_size, "tp_rank": rank, "dtype": args.dtype}
        ready_path.write_text(f"pid={os.getpid()}\nconfig={config!r}\n")  # a Python dict literal, as upstream
        made.append((sock, sock_path, ready_path))
    double_http.log(f"weight cache daemon ready for {len(made)} rank(s)")
    # Like SGLang's launcher, no SIGTERM handler: SIGTERM kills it at once and
    # the .sock/.ready files are left behind.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
