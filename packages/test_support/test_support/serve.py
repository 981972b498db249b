"""Serve a bundle, the sample one by default, as an OpenEnv env until Ctrl-C: ``python -m test_support.serve
[BUNDLE] [--max-concurrent-envs N]``. It prints the server's URL alone on the first line of stdout, for a demo or a
script to read, and the env's name on stderr.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from test_support.env_server import ServerFailed, serve_bundle
from test_support.scripts import SAMPLE_BUNDLE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m test_support.serve", description=__doc__.split(":")[0])
    parser.add_argument("bundle", nargs="?", type=Path, default=SAMPLE_BUNDLE, help="the bundle folder to serve")
    parser.add_argument("--max-concurrent-envs", type=int, default=8, help="WebSocket sessions it serves at once")
    args = parser.parse_args(argv)
    try:
        with serve_bundle(args.bundle, max_concurrent_envs=args.max_concurrent_envs) as served:
            print(served.url, flush=True)
            print(f"serving {args.bundle} as the env {served.env_name!r}; Ctrl-C stops it", file=sys.stderr)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            while True:
                signal.pause()
    except KeyboardInterrupt:
        return 0
    except (ServerFailed, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
