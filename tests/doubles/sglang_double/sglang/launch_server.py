"""TEST DOUBLE of `python -m sglang.launch_server`: exists only to test hostd's orchestration.

Not SGLang and loads nothing. Its parser is SGLang 0.5.23's own flag set
(tests/upstream/flags/): it rejects what SGLang rejects. In --weight-cache-mode client it looks for each visible
GPU's daemon socket (SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE) and, like upstream,
falls back to disk only when the socket file is missing. Serves /health and a
canned OpenAI API on --host/--port; on SIGTERM it drains without a time limit,
as upstream does.
"""

from __future__ import annotations

import os
import sys

from sglang import _common
from sglang._common import double_http, first, paths_for


def build_parser():
    return _common.build_parser("sglang serve", "launch_server")


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    args.port = int(args.port or 30000)
    args.host = args.host or "127.0.0.1"
    args.served_model_name = first(args.served_model_name)
    if os.environ.get("HOSTD_TEST_ENGINE_FAIL"):
        sys.exit("double: failing on purpose (HOSTD_TEST_ENGINE_FAIL)")
    fail_at = os.environ.get("HOSTD_TEST_FAIL_MAX_RUNNING_REQUESTS")
    if args.max_running_requests is not None and str(args.max_running_requests) == fail_at:
        sys.exit(f"double: failing on purpose for --max-running-requests {args.max_running_requests}")
    if args.weight_cache_mode == "client":
        for uuid in double_http.gpu_uuids():
            sock_path, _ready = paths_for(uuid)
            if not sock_path.exists():
                double_http.log(f"no weight cache socket {sock_path}; loading from disk")
            else:
                double_http.log(f"loaded weights from the weight cache daemon at {sock_path}")
    health = {"double": "sglang", "argv": sys.argv[1:], "jit_cache_dir": os.environ.get("SGLANG_JIT_CACHE_DIR")}
    return double_http.serve((args.host, args.port), args.served_model_name or args.model_path, health, None)


if __name__ == "__main__":
    sys.exit(main())
