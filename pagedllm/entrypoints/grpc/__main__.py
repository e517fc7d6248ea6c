"""``python -m pagedllm.entrypoints.grpc``: generate (or find in the cache) the gRPC stubs now,
so that the first ``pagedllm serve --grpc`` does not wait for them; prints their directory."""

from __future__ import annotations

import sys

from pagedllm.entrypoints.grpc.stubs import stubs_dir


def main() -> int:
    print(f"pagedllm gRPC stubs ready in {stubs_dir()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
