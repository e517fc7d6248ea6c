"""The Python modules of ``pagedllm_generation.proto``, generated on first use.

Only the ``.proto`` is in the package: generated ``*_pb2`` code is tied to the protobuf
runtime it was generated for, so it is generated here, by grpcio-tools' ``protoc``, for
the installed grpcio-tools and protobuf, into a cache directory
``~/.cache/pagedllm/grpc/<key>`` (``key``: a hash of the .proto and both versions; a
change of either makes a new one). ``make install`` runs ``python -m
pagedllm.entrypoints.grpc`` so that the first ``pagedllm serve --grpc`` finds them ready;
otherwise the first call generates them (well under a second). A home directory that
cannot be written falls back to a directory under the system's temporary directory.

``load_stubs()`` returns ``(messages, services)``: the ``pagedllm_generation_pb2`` and
``pagedllm_generation_pb2_grpc`` modules (registered in ``sys.modules`` under those names,
which the generated service module imports).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PROTO_PATH = Path(__file__).with_name("pagedllm_generation.proto")
MESSAGES_MODULE = "pagedllm_generation_pb2"
SERVICES_MODULE = "pagedllm_generation_pb2_grpc"
CACHE_DIR = Path("~/.cache/pagedllm/grpc")


def stubs_key() -> str:
    """A hash of the .proto, grpcio-tools' version and protobuf's (16 hex digits).

    Raises:
        ImportError: grpcio-tools or protobuf is not installed.
    """
    import google.protobuf
    import grpc_tools

    versions = f"{getattr(grpc_tools, '__version__', '')}|{google.protobuf.__version__}".encode()
    return hashlib.sha256(PROTO_PATH.read_bytes() + versions).hexdigest()[:16]


def _generate(out_dir: Path) -> None:
    """Run protoc on ``PROTO_PATH`` into ``out_dir`` (written to a temporary sibling first,
    then renamed, so that a concurrent start never sees half a directory).

    Raises:
        RuntimeError: protoc failed (its exit status).
    """
    from grpc_tools import protoc

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        status = protoc.main(
            ["protoc", f"-I{PROTO_PATH.parent}", f"--python_out={staging}", f"--grpc_python_out={staging}", str(PROTO_PATH)]
        )
        if status != 0:
            raise RuntimeError(f"grpcio-tools' protoc failed on {PROTO_PATH} (exit status {status}).")
        try:
            os.rename(staging, out_dir)
        except OSError:  # another process renamed its copy first
            if not (out_dir / f"{SERVICES_MODULE}.py").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def stubs_dir() -> Path:
    """The directory holding the generated modules, generating them when missing.

    Raises:
        ImportError: grpcio-tools or protobuf is not installed.
        RuntimeError: protoc failed.
    """
    key = stubs_key()
    for root in (CACHE_DIR.expanduser(), Path(tempfile.gettempdir()) / "pagedllm-grpc"):
        out_dir = root / key
        if (out_dir / f"{SERVICES_MODULE}.py").is_file():
            return out_dir
        try:
            _generate(out_dir)
        except PermissionError:
            continue
        return out_dir
    raise PermissionError(f"cannot write the gRPC stubs to {CACHE_DIR} or the temporary directory.")


def _load(name: str, directory: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def load_stubs() -> tuple[ModuleType, ModuleType]:
    """``(messages, services)``: the generated message and service modules (see the module
    docstring); generated on the first call of a machine, then read from the cache.

    Raises:
        ImportError: grpcio-tools or protobuf is not installed.
        RuntimeError: protoc failed.
    """
    directory = stubs_dir()
    messages = _load(MESSAGES_MODULE, directory)
    return messages, _load(SERVICES_MODULE, directory)
