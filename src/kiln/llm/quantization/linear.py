"""Quantized projections: the checkpoint's tensors as loaded (``CheckpointLinear``), then the
form a kernel computes with (``Int4Linear``, ``Int8Linear``, ``Fp8Linear``) or, where no
kernel applies, a plain ``nn.Linear`` holding the dequantized weight.

CPU kernels take bf16 activations: torch's ``_weight_int4pack_mm_for_cpu`` and
``_weight_int8pack_mm`` are 10-20x slower with float32 ones on an AVX2 host (measured:
docs/design/llm-quantization.md), so a float32 model's activations are rounded to bf16 for
these products only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm.quantization import gguf_blocks, packing
from kiln.llm.quantization.config import QuantConfig

#: the int4 group sizes torch's packed kernels take
KERNEL_GROUPS = (32, 64, 128, 256)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bias(parts: Sequence[nn.Linear]) -> torch.Tensor | None:
    if parts[0].bias is None:
        return None
    return torch.cat([p.bias for p in parts])


class QuantLinear(nn.Linear):
    """An ``nn.Linear`` (so the model's code treats it as one) without a float weight."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        param = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.register_parameter("bias", param)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def stack(self, parts: Sequence[nn.Linear]) -> nn.Linear:
        """One projection computing ``parts`` (the model's q/k/v or gate/up fusion)."""
        return ConcatLinear(parts)


class ConcatLinear(QuantLinear):
    """Projections that cannot share one matrix (their inputs are permuted differently:
    GPTQ act-order), run one after the other into one output."""

    def __init__(self, parts: Sequence[nn.Linear]) -> None:
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), None)
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class Int4Linear(QuantLinear):
    """4-bit weights in torch's packed layout: ``_weight_int4pack_mm_for_cpu`` (CPU) or
    ``_weight_int4pack_mm`` (CUDA), both computing ``(q - 8) * scale + zero`` per group."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    perm: torch.Tensor | None

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        group_size: int,
        perm: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        n, k = q.shape
        super().__init__(k, n, bias)
        self.group_size = group_size
        sz = torch.stack([scale, offset], dim=-1).to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz.contiguous())
        #: act-order: the input's columns in group order
        self.register_buffer("perm", perm)
        if q.device.type == "cuda":
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiles = 8 if k % 128 == 0 else 2  # inner k-tiles of 16: K must fill them
            self.register_buffer(
                "packed", torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
            )
        else:
            self.register_buffer(
                "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.perm is not None:
            h = h[:, self.perm]
        if h.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(
                h, self.packed, self.group_size, self.scales_and_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                h, self.packed, self.group_size, self.scales_and_zeros
            )
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return cast(torch.Tensor, out)

    def stack(self, parts: Sequence[nn.Linear]) -> nn.Linear:
        ints = [p for p in parts if isinstance(p, Int4Linear)]
        same = len(ints) == len(parts) and all(
            p.perm is None and p.group_size == self.group_size for p in ints
        )
        if not same or self.packed.device.type != "cpu":
            return ConcatLinear(parts)
        fused = Int4Linear.__new__(Int4Linear)
        QuantLinear.__init__(
            fused, self.in_features, sum(p.out_features for p in parts), _bias(parts)
        )
        fused.group_size = self.group_size
        fused.register_buffer("scales_and_zeros", torch.cat([p.scales_and_zeros for p in ints], 1))
        fused.register_buffer("perm", None)
        # packed again from the parts' 4-bit values: the CPU layout is the ISA's (rows
        # stand alone with AVX2, are tiled with AVX-512), so packed parts never concatenate
        q = torch.cat([p.unpack_cpu() for p in ints])
        fused.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        return fused

    def unpack_cpu(self) -> torch.Tensor:
        """The 4-bit values [out, in] (int32, 0..15) back from the CPU-packed weight: its
        product with the identity under scale 1 and zero 8 is each value, exactly (small
        integers are exact in bfloat16)."""
        groups = self.in_features // self.group_size
        unit = torch.stack(
            [torch.ones(groups, self.out_features), torch.full((groups, self.out_features), 8.0)],
            dim=-1,
        ).to(torch.bfloat16)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        values = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, unit.contiguous()
        )
        return cast(torch.Tensor, values.t().round().int().contiguous())


class Int8Linear(QuantLinear):
    """int8 weights with one scale per output row: ``_weight_int8pack_mm`` on the CPU (bf16
    activations), the weight dequantized per call elsewhere."""

    weight_scale: torch.Tensor
    scale_bf16: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", scale.reshape(-1).float())
        self.register_buffer("scale_bf16", self.weight_scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        if h.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(
                h.to(torch.bfloat16), self.weight, self.scale_bf16
            ).to(x.dtype)
        else:
            out = F.linear(h, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        out = out.reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return cast(torch.Tensor, out)

    def stack(self, parts: Sequence[nn.Linear]) -> nn.Linear:
        ints = [p for p in parts if isinstance(p, Int8Linear)]
        if len(ints) != len(parts):
            return ConcatLinear(parts)
        return Int8Linear(
            torch.cat([p.weight for p in ints]),
            torch.cat([p.weight_scale for p in ints]),
            _bias(parts),
        )


def scaled_mm_usable(device: torch.device) -> bool:
    """``torch._scaled_mm`` takes fp8 operands on compute capability 8.9+ (Ada, Hopper)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(QuantLinear):
    """fp8 (e4m3) weights with one scale per output row, computed by ``torch._scaled_mm``
    with activations quantized per token at run time (vLLM's dynamic W8A8-FP8)."""

    weight_scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        # _scaled_mm wants the second operand column-major: keep w.t() of a row-major w
        self.register_buffer("weight", weight.to(torch.float8_e4m3fn).contiguous())
        self.register_buffer("weight_scale", scale.reshape(1, -1).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        finfo = torch.finfo(torch.float8_e4m3fn)
        amax = h.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        x_scale = amax / finfo.max
        xq = (h.float() / x_scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*shape[:-1], self.out_features)

    def stack(self, parts: Sequence[nn.Linear]) -> nn.Linear:
        fp8 = [p for p in parts if isinstance(p, Fp8Linear)]
        if len(fp8) != len(parts):
            return ConcatLinear(parts)
        return Fp8Linear(
            torch.cat([p.weight for p in fp8]),
            torch.cat([p.weight_scale.reshape(-1) for p in fp8]),
            _bias(parts),
        )


class CheckpointLinear(nn.Module):
    """A quantized projection's tensors exactly as the checkpoint holds them (names, shapes,
    dtypes), to be loaded like any other weight and then ``prepare``d."""

    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
        quant: QuantConfig,
        dtype: torch.dtype,
        device: torch.device,
        ggml_type: str = "",
    ) -> None:
        super().__init__()
        self.name, self.quant, self.dtype = name, quant, dtype
        #: GGUF: the weight's block type (gguf_blocks.BLOCKS)
        self.ggml_type = ggml_type
        self.in_features, self.out_features = in_features, out_features
        for key, (shape, dt) in tensors.items():
            self.register_buffer(key, torch.empty(shape, dtype=dt, device=device))

    def _apply(self, fn: Any, recurse: bool = True) -> CheckpointLinear:
        # the model's .to(dtype) must not cast the checkpoint's tensors (an fp8 weight,
        # fp16 scales): they load as stored
        dtypes = {k: b.dtype for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for key, dtype in dtypes.items():
            buffer = self._buffers[key]
            if buffer is not None and buffer.dtype != dtype:
                self._buffers[key] = buffer.to(dtype)
        return self

    def _get(self, key: str) -> torch.Tensor | None:
        return self._buffers.get(key)

    def _bias(self) -> torch.Tensor | None:
        bias = self._get("bias")
        return None if bias is None else bias.to(self.dtype)

    def _refuse(self, reason: str) -> KilnError:
        return KilnError(f"llm backend: {self.name}: {reason}", Status.INVALID_ARG)

    def _dense(self, weight: torch.Tensor) -> nn.Linear:
        bias = self._bias()
        out = nn.Linear(
            self.in_features,
            self.out_features,
            bias=bias is not None,
            device=weight.device,
            dtype=self.dtype,
        )
        with torch.no_grad():
            out.weight.copy_(weight)
            if bias is not None:
                out.bias.copy_(bias)
        return out.requires_grad_(False)

    def prepare(self) -> nn.Linear:
        kind = self.quant.weights
        if kind == "int4":
            return self._int4()
        if kind == "gguf":
            raw = self._get("weight")
            assert raw is not None
            q, scales, offset = gguf_blocks.to_int4(raw, self.ggml_type, self.in_features)
            return self._packed(q, scales, offset, 32, None)
        weight = self._get("weight")
        assert weight is not None  # checked when the tensors were listed
        if weight.shape != (self.out_features, self.in_features):
            raise self._refuse(f"weight has shape {list(weight.shape)}")
        scale = self._get("weight_scale")
        block = self._get("weight_scale_inv")
        if kind == "fp8":
            if block is not None:
                return self._dense(self._block_dequantize(weight, block))
            assert scale is not None
            rows = self._row_scale(scale)
            if scaled_mm_usable(weight.device):
                return Fp8Linear(weight, rows, self._bias())
            return self._dense(weight.float() * rows.unsqueeze(1))
        assert scale is not None
        if weight.dtype != torch.int8:
            raise self._refuse(f"an int8 checkpoint holds a {weight.dtype} weight")
        return Int8Linear(weight, self._row_scale(scale), self._bias())

    def _row_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """Per-tensor ([], [1]) or per-channel ([N], [N, 1]) scales -> [N] float32."""
        if scale.numel() == 1:
            return scale.float().reshape(1).expand(self.out_features).contiguous()
        if scale.numel() == self.out_features:
            return scale.float().reshape(-1)
        raise self._refuse(
            f"weight_scale has shape {list(scale.shape)}: neither per-tensor nor per-channel "
            f"({self.out_features} rows)"
        )

    def _block_dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """Block-wise fp8 (``weight_block_size`` [bn, bk]: one scale a tile)."""
        n, k = weight.shape
        gn, gk = scale_inv.shape
        bn, bk = -(-n // gn), -(-k // gk)
        full = scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        return weight.float() * full

    def _int4(self) -> nn.Linear:
        quant, n, k = self.quant, self.out_features, self.in_features
        qweight, qzeros, scales = self._get("qweight"), self._get("qzeros"), self._get("scales")
        assert qweight is not None and qzeros is not None and scales is not None
        group = k if quant.group_size == -1 else quant.group_size
        if k % group:
            raise self._refuse(f"{k} input features are not a multiple of group_size {group}")
        groups = k // group
        want = {
            "qweight": (k, n // 8) if quant.method == "awq" else (k // 8, n),
            "qzeros": (groups, n // 8),
            "scales": (groups, n),
        }
        for key, shape in want.items():
            have = tuple(getattr(self, key).shape)
            if have != shape:
                raise self._refuse(f"{key} has shape {list(have)}, expected {list(shape)}")
        if quant.method == "awq":
            q, scale, zero = packing.awq_to_int4(qweight, qzeros, scales)
        else:
            q, scale, zero = packing.gptq_to_int4(qweight, qzeros, scales, quant.zero_offset)
        default = torch.arange(k, device=q.device) // group
        g_idx = self._get("g_idx")
        g_idx = default if g_idx is None else g_idx.long()
        perm = None
        if not torch.equal(g_idx, default):
            # act-order: gather the input's columns so that each group is contiguous
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], default):
                raise self._refuse("g_idx does not give every group group_size rows")
            q = q[:, perm]
        # (q - z) * s == (q - 8) * s + (8 - z) * s: the kernel's form
        return self._packed(q, scale, (8 - zero) * scale, group, perm)

    def _packed(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        group: int,
        perm: torch.Tensor | None,
    ) -> nn.Linear:
        """The packed int4 kernel's module, or where it does not apply (its group sizes,
        output rows a multiple of 16, CPU or CUDA) the dequantized weight."""
        kernel = group in KERNEL_GROUPS and q.shape[0] % 16 == 0
        if kernel and q.device.type in ("cpu", "cuda"):
            return Int4Linear(q, scale, offset, group, perm, self._bias())
        s, o = scale.repeat_interleave(group, 0).t(), offset.repeat_interleave(group, 0).t()
        weight = (q.float() - 8) * s + o
        if perm is not None:  # back to the checkpoint's column order
            weight = torch.empty_like(weight).index_copy_(1, perm, weight)
        return self._dense(weight)
