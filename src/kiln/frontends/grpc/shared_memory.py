"""Shared-memory RPCs for gRPC. Region bookkeeping and bounds checks are core's
(:mod:`kiln.core.shm`); reading inputs from and writing outputs to regions is shared with
HTTP (:mod:`kiln.frontends.shm_io`). CUDA shared memory needs a GPU and CUDA IPC, which
kiln does not implement: those RPCs answer UNIMPLEMENTED with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.errors import guarded
from kiln.server.server import Server

Context = Any  # grpc.aio.ServicerContext


def _has_gpu() -> bool:
    # The NVIDIA driver's control node: present exactly where CUDA IPC could work.
    return Path("/dev/nvidiactl").exists()


def _cuda_unsupported() -> KilnError:
    why = "kiln does not implement CUDA IPC yet" if _has_gpu() else "this machine has no NVIDIA GPU"
    return KilnError(
        f"CUDA shared memory is not supported: {why}; use system shared memory or send "
        "tensors in raw_input_contents",
        Status.UNSUPPORTED,
    )


class SharedMemoryRpcs:
    """Mixed into the inference servicer: the six shared-memory RPCs."""

    server: Server

    @guarded
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        answer = pb.SystemSharedMemoryStatusResponse()
        for region in self.server.shm.status(request.name):
            answer.regions[str(region["name"])].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)  # type: ignore[arg-type]
            )
        return answer

    @guarded
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.server.shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @guarded
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.server.shm.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @guarded
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise KilnError(
                f"Unable to find cuda shared memory region: '{request.name}'", Status.NOT_FOUND
            )
        return pb.CudaSharedMemoryStatusResponse()

    @guarded
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise _cuda_unsupported()

    @guarded
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        if request.name:
            raise _cuda_unsupported()
        return pb.CudaSharedMemoryUnregisterResponse()
