"""Shared-memory RPCs and the hook that resolves shared-memory tensors of a request.

Not implemented yet: every RPC answers UNIMPLEMENTED with a message saying why, and a
request that names a region is refused before it reaches a model. The system
shared-memory step replaces :meth:`SharedMemoryRpcs.resolve_inputs` /
:meth:`SharedMemoryRpcs.write_outputs` and the three ``SystemSharedMemory*`` methods; the
inference servicer already calls them at the right places.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.core.types import InferenceRequest, InferenceResponse
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.codec import SHM_REGION
from kiln.frontends.grpc.errors import guarded

Context = Any  # grpc.aio.ServicerContext


def _has_gpu() -> bool:
    # The NVIDIA driver's control node: present exactly where CUDA IPC could work.
    return Path("/dev/nvidiactl").exists()


def _system_unsupported() -> KilnError:
    return KilnError(
        "system shared memory is not supported by this kiln server yet: send tensors in "
        "raw_input_contents",
        Status.UNSUPPORTED,
    )


def _cuda_unsupported() -> KilnError:
    why = "kiln does not implement CUDA IPC yet" if _has_gpu() else "this machine has no NVIDIA GPU"
    return KilnError(
        f"CUDA shared memory is not supported: {why}; send tensors in raw_input_contents",
        Status.UNSUPPORTED,
    )


class SharedMemoryRpcs:
    """Mixed into the inference servicer: the six shared-memory RPCs and the request hooks."""

    def resolve_inputs(self, request: InferenceRequest) -> None:
        """Fill in the data of inputs that name a shared-memory region (none yet)."""
        for tensor in request.inputs:
            if SHM_REGION in tensor.parameters:
                raise KilnError(
                    f"input '{tensor.name}' names shared-memory region "
                    f"'{tensor.parameters[SHM_REGION]}', but {_system_unsupported().message}",
                    Status.UNSUPPORTED,
                )
        for out in request.outputs:
            if SHM_REGION in out.parameters:
                raise KilnError(
                    f"output '{out.name}' names shared-memory region "
                    f"'{out.parameters[SHM_REGION]}', but {_system_unsupported().message}",
                    Status.UNSUPPORTED,
                )

    def write_outputs(
        self, request: InferenceRequest, response: InferenceResponse, message: pb.ModelInferResponse
    ) -> None:
        """Copy outputs that asked for a region into it (none yet: resolve_inputs refused)."""

    @guarded
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        raise _system_unsupported()

    @guarded
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        raise _system_unsupported()

    @guarded
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        raise _system_unsupported()

    @guarded
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        raise _cuda_unsupported()

    @guarded
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise _cuda_unsupported()

    @guarded
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        raise _cuda_unsupported()
