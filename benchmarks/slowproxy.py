"""The slow store alone (`tests.slowproxy.SlowProxy`), in front of a server you run.

    python benchmarks/slowproxy.py --upstream http://127.0.0.1:8000 [--port 9000] \
        [--delay-ms 50] [--mb-per-s 20]

Adds `--delay-ms` before the first byte of every HTTP request's answer and caps each
connection at `--mb-per-s`, as `remote_loader.py` does to its HTTP and S3 servers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.slowproxy

from tests.slowproxy import SlowProxy  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="http://host:port of the server")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="added to each request")
    parser.add_argument("--mb-per-s", type=float, default=20.0, help="cap per connection, MB/s")
    args = parser.parse_args(argv)
    proxy = SlowProxy(
        args.upstream, delay_s=args.delay_ms / 1000, bytes_per_s=args.mb_per_s * 1e6, port=args.port
    )
    with proxy as url:
        print(f"{url} -> {args.upstream} (+{args.delay_ms:g} ms, {args.mb_per_s:g} MB/s)")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
